"""``make model``'s kernel check (engine_workers/kernels/readiness.py): every kernel of the extension
module is built and checked, the weight-format kernels included, a failing one is named, and a CPU
without a speed flag (VNNI, avx512_bf16, AVX-512) is not a failure."""

from __future__ import annotations

import pytest
import torch

from engine_workers.kernels import cpu_blocks, cpu_kernels, lowp_kernels, readiness, w8a8_linear
from engine_workers.kernels.cpu_linear import lowp_problem


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
                                           ("blocks", "Q4_1/Q8_0 block linear"), ("w8a8", "W8A8 linear")])
def test_a_failing_kernel_is_reported_by_name(all_ready: None, monkeypatch: pytest.MonkeyPatch, key: str,
                                              name: str) -> None:
    # as the kernel's resolution records a failed build or check, once per process
    monkeypatch.setitem(cpu_kernels._state, key, None)
    monkeypatch.setitem(cpu_kernels._state, key + "_problem", "disagrees with torch (planted)")
    assert readiness.problems() == f"{name}: disagrees with torch (planted)"


def test_a_cpu_without_the_speed_flags_is_not_a_problem(all_ready: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # the kernels still build and pass their checks there (plain loops); the engine refuses the
    # modes at load, naming the flag
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma"})
    assert readiness.problems() is None
    assert "VNNI" in (lowp_problem("w8a8") or "")
    assert "avx512f" in (lowp_problem("int8") or "")
    assert "avx512f" in (lowp_problem("q4_1") or "")


def test_w8a8_kernel_problem_is_the_build_and_check_only(all_ready: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx512f"})
    assert "VNNI" in (w8a8_linear.w8a8_problem() or "")
    assert w8a8_linear.w8a8_kernel_problem() is None
    monkeypatch.delattr(torch, "_int_mm")
    assert "_int_mm" in (w8a8_linear.w8a8_kernel_problem() or "")
