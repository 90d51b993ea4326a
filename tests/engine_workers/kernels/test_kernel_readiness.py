"""``make model``'s kernel check (engine_workers/kernels/readiness.py): every kernel of the extension
module is built and checked, the weight-format kernels included, a failing one is named, and a CPU
without a speed flag (VNNI, avx512_bf16, AVX-512) is not a failure. Run at every ISA level this host
can (tests/conftest.py, ``isa``)."""

from __future__ import annotations

import pytest
import torch

from engine_workers.kernels import cpu_blocks, cpu_kernels, lowp_kernels, readiness, w8a8_linear
from engine_workers.kernels.cpu_linear import lowp_problem

# every test at each ISA level this host runs (tests/engine_workers/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")


@pytest.fixture
def all_ready() -> None:
    why = readiness.problems()
    if why is not None:
        pytest.skip(f"the CPU kernels are not all available here: {why}")


def test_ready_means_every_kernel_resolved(all_ready: None) -> None:
    assert cpu_kernels.paged_decode() is not None and cpu_kernels.prefill_attention() is not None
    assert cpu_kernels.small_m() is not None and cpu_kernels.fused() is not None
    assert lowp_kernels.lowp() is not None
    assert cpu_blocks.block_ops() is not None
    assert w8a8_linear.w8a8_ops() is not None


@pytest.mark.parametrize(("key", "name"), [("decode", "paged decode attention"), ("lowp", "bf16/int8 linear"),
                                           ("blocks", "Q4_1/Q8_0 block linear"), ("w8a8", "W8A8 linear"),
                                           ("amx_tiles", "AMX tile bf16 linear")])
def test_a_failing_kernel_is_reported_by_name(all_ready: None, monkeypatch: pytest.MonkeyPatch, key: str,
                                              name: str) -> None:
    if key == "amx_tiles" and cpu_kernels.isa_level() != "amx":
        pytest.skip("the AMX tile kernel is checked at the amx level only")
    # as the kernel's resolution records a failed build or check, once per process
    monkeypatch.setitem(cpu_kernels._state, key, None)
    monkeypatch.setitem(cpu_kernels._state, key + "_problem", "disagrees with torch (planted)")
    assert readiness.problems() == f"{name}: disagrees with torch (planted)"


def test_a_cpu_without_the_speed_flags_is_not_a_problem(all_ready: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # the kernels still build and pass their checks there; only below AVX2 + FMA (plain loops)
    # the engine refuses the modes at load, naming the flags
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert readiness.problems() is None
    for kind in ("w8a8", "int8", "q4_1", "bfloat16"):
        assert lowp_problem(kind) is None, kind
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"sse2"})
    monkeypatch.setattr(cpu_kernels, "isa_level", lambda: "generic")
    assert readiness.problems() is None
    for kind in ("w8a8", "int8", "q4_1"):
        assert "avx2, fma, f16c" in (lowp_problem(kind) or ""), kind


def test_w8a8_kernel_problem_is_the_build_and_check_only(all_ready: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "isa_level", lambda: "generic")
    assert "AVX2" in (w8a8_linear.w8a8_problem() or "")
    assert w8a8_linear.w8a8_kernel_problem() is None
    monkeypatch.delattr(torch, "_int_mm")
    assert "_int_mm" in (w8a8_linear.w8a8_kernel_problem() or "")


# Each entry point with one argument on the meta device (no data at all: reading it would crash,
# not raise) and CPU tensors elsewhere: (module, meta [4, 2, 8], cpu3 [4, 2, 8], cpu2 [4, 16], cpu1 [4]).
_OFF_CPU_CALLS = {
    "prefill_attention": lambda m, meta, c3, c2, c1: m.prefill_attention(c3, c3, meta, 1.0),
    "paged_decode": lambda m, meta, c3, c2, c1: m.paged_decode(meta, c3, c3, torch.zeros(1, 1, dtype=torch.long),
                                                               torch.ones(1, dtype=torch.long), 4, 1.0),
    "paged_decode_loop": lambda m, meta, c3, c2, c1: m.paged_decode_loop(c3, meta, c3, torch.zeros(1, 1, dtype=torch.long),
                                                                         torch.ones(1, dtype=torch.long), 4, 1.0),
    "add_rms_norm": lambda m, meta, c3, c2, c1: m.add_rms_norm(c2, meta.view(4, 16), c1, 1e-6),
    "silu_mul": lambda m, meta, c3, c2, c1: m.silu_mul(meta.view(4, 16)),
    "small_m_linear": lambda m, meta, c3, c2, c1: m.small_m_linear(c2, c2, 4, meta.view(-1)),
    "linear_i8": lambda m, meta, c3, c2, c1: m.linear_i8(c2, meta.view(4, 16), c1, 4, None),
    "linear_bf16": lambda m, meta, c3, c2, c1: m.linear_bf16(meta.view(4, 16), c2, 4, None),
    "linear_bf16f": lambda m, meta, c3, c2, c1: m.linear_bf16f(c2, meta.view(4, 16), 4, None),
    "quantize_rows_i8": lambda m, meta, c3, c2, c1: m.quantize_rows_i8(meta.view(4, 16)),
    "dequant_i32": lambda m, meta, c3, c2, c1: m.dequant_i32(c2.int(), c1, meta.view(-1)[:16], None),
    "silu_mul_quant_i32": lambda m, meta, c3, c2, c1: m.silu_mul_quant_i32(meta.view(4, 16).int(), c1, c1, None),
    "block_linear": lambda m, meta, c3, c2, c1: m.block_linear(meta.view(4, 16), c2, 0, 4, None),
    "block_dequant_t": lambda m, meta, c3, c2, c1: m.block_dequant_t(meta.view(4, 16), 0, 4, 4),
    "pack_i8": lambda m, meta, c3, c2, c1: m.pack_i8(meta.view(4, 16).to(torch.int8)),
    "pack_bf16": lambda m, meta, c3, c2, c1: m.pack_bf16(meta.view(4, 16)),
    "pack_small_m": lambda m, meta, c3, c2, c1: m.pack_small_m(meta.view(4, 16)),
    # checked before anything else, so at every level (the stub below amx too)
    "pack_amx_bf16": lambda m, meta, c3, c2, c1: m.pack_amx_bf16(meta.view(4, 16)),
    "linear_amx_bf16": lambda m, meta, c3, c2, c1: m.linear_amx_bf16(c2, meta.view(1, 1, 8, 4, 2).short(), 4, None),
}


@pytest.mark.parametrize("name", list(_OFF_CPU_CALLS))
def test_kernels_refuse_a_tensor_off_the_cpu(all_ready: None, name: str) -> None:
    """The kernels read raw host pointers: a tensor on another device is refused by name (the
    argument's) before anything is read."""
    m, _ = cpu_kernels._module()
    meta = torch.empty(4, 2, 8, device="meta")
    with pytest.raises(RuntimeError, match=r"\w+ must be a CPU tensor .* got one on meta"):
        _OFF_CPU_CALLS[name](m, meta, torch.zeros(4, 2, 8), torch.zeros(4, 16), torch.zeros(4))
