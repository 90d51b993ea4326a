"""W8A8 linear layers on CPU (``--quantization w8a8``; engine_workers/kernels/w8a8_linear.py and
csrc/int8_act.cpp): the kernels against torch references, the mode's plan and refusals, and the
engine's logits and greedy tokens against float32 within stated bounds.

Bounds (measured, with margin): the int32 sums are exact, so a layer differs from its reference
only by float32 scaling (~1e-6). Against the float32 layer the error is int8 weights plus int8
activations, relative L2 ~1.5e-2 on random data. Through SmolLM2-135M (6 chat prompts) the
next-token logits' error is a spread, not a figure: per-row int8 activations round by their last
bits, so a last-bit change upstream (another ISA level's float32 kernels) moves it. Measured with
the activation smoothing (engine_workers/model/smoothing.py) over 8 last-bit perturbations of the
embeddings at each level of an AMX host: 0.045-0.068 (avx512), 0.042-0.075 (avx2); without it
0.067-0.129, which crossed the old bound of 0.12 on that host (issue #47; docs/benchmarks.md,
"w8a8 across hosts"). The bound below is the measured maximum with a third of margin."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from benchmarks.engine.accuracy import decode
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.kernels import cpu_kernels as kernels
from engine_workers.kernels import lowp_kernels
from engine_workers.kernels.cpu_linear import cpu_weight_plan
from engine_workers.kernels.w8a8_linear import W8A8GatedMLP, W8A8Linear, quantize_rows, reference, w8a8_ops, w8a8_problem
from tests.engine_workers.kernels.test_lowp_weights import TINY_PROMPTS, agreement, greedy, next_logits, rel_l2

# every test at each ISA level this host runs (tests/engine_workers/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")

CPU = torch.device("cpu")
needs_w8a8 = pytest.mark.skipif(w8a8_problem() is not None, reason=f"W8A8: {w8a8_problem()}")


@needs_w8a8
@pytest.mark.parametrize(("m", "k"), [(1, 64), (5, 71), (33, 576), (300, 17)])
def test_row_quantization_kernel_is_exactly_the_reference(m: int, k: int) -> None:
    ops = w8a8_ops()
    assert ops is not None
    x = torch.randn(m, k) * torch.logspace(-3, 3, m)[:, None]  # rows of very different scales
    x[0] = 0.0
    q, s = ops.quantize_rows(x)
    rq, rs = quantize_rows(x)
    assert torch.equal(q, rq) and q.dtype == torch.int8
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    assert s[0] == 1.0 and not q[0].any()
    if m > 1:
        assert int(q[1:].abs().amax(1).min()) == 127  # every non-zero row uses the full range


@needs_w8a8
def test_row_quantization_of_near_subnormal_rows_keeps_signs() -> None:
    """A row whose largest magnitude is below 127 x float32's smallest normal would get a
    subnormal scale with an infinite inverse; the scale is floored at that normal instead, so
    signs and order survive (as in the reference)."""
    ops = w8a8_ops()
    assert ops is not None
    x = torch.zeros(3, 40)
    x[0, :4] = torch.tensor([1e-37, -1e-37, 5e-38, 0.0])
    x[1, 20:36] = torch.linspace(-3e-37, 3e-37, 16)  # lanes of the vector loop
    x[2] = torch.randn(40)
    q, s = ops.quantize_rows(x)
    rq, rs = quantize_rows(x)
    assert torch.equal(q, rq)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    assert bool(torch.all(torch.sign(q[:2].float()) == torch.sign(x[:2]) * (q[:2] != 0)))
    assert q[0, 0] > 0 > q[0, 1] and q[1, 35] > 0 > q[1, 20]


@needs_w8a8
@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 64), (3, 1, 7), (7, 100, 71), (64, 960, 576), (512, 130, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_linear_matches_its_reference_and_is_close_to_float32(m: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    lin = W8A8Linear.from_weight(w, b)
    q, s = lowp_kernels.quantize_int8(w)
    got = lin(x)
    torch.testing.assert_close(got, reference(x, q, s, b), rtol=1e-5, atol=1e-5)
    if k >= 64:  # a few-term sum has no averaging; the bound is for layer-sized K
        assert rel_l2(got, F.linear(x, w, b)) < 0.03


@needs_w8a8
def test_w8a8_linear_keeps_leading_dims_and_zero_rows() -> None:
    lin = W8A8Linear.from_weight(torch.randn(40, 24))
    x = torch.randn(2, 3, 24)
    assert lin(x).shape == (2, 3, 40)
    assert lin(torch.randn(0, 24)).shape == (0, 40)
    torch.testing.assert_close(lin(x)[1], lin(x[1]))  # per-row quantization: a row's result is its own
    # int8 weight + scales; at avx2 also int8_gemm's k-pair panels (40 columns padded to one panel of 96)
    panels = 96 * 24 if kernels.isa_level() == "avx2" else 0
    assert lin.weight_bytes() == 40 * 24 + 40 * 4 + panels


@needs_w8a8
@pytest.mark.parametrize(("m", "i", "k"), [(1, 48, 64), (6, 50, 33), (300, 96, 40), (0, 16, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_is_the_three_layers_in_sequence(m: int, i: int, k: int, bias: bool) -> None:
    """W8A8GatedMLP (gate|up GEMM -> fused silu * up + quantize -> down GEMM) against the unfused
    path: gate|up W8A8Linear, torch's silu * up, down W8A8Linear. The down GEMM's int8 input may
    differ by one rounding step where silu's expf differs in its last bit, so the outputs agree
    to int8 resolution, not bitwise; the float32 MLP is the looser reference."""
    gen = torch.Generator().manual_seed(m + i)
    w_gu, w_d = torch.randn(2 * i, k, generator=gen), torch.randn(k, i, generator=gen)
    b_gu, b_d = (torch.randn(2 * i, generator=gen), torch.randn(k, generator=gen)) if bias else (None, None)
    gate_up, down = W8A8Linear.from_weight(w_gu, b_gu), W8A8Linear.from_weight(w_d, b_d)
    mlp = W8A8GatedMLP(gate_up, down)
    x = torch.randn(m, k, generator=gen)
    y = gate_up(x)
    want = down(F.silu(y[:, :i]) * y[:, i:])
    got = mlp(x)
    assert got.shape == (m, k)
    if m:
        assert rel_l2(got, want) < 2e-3
        yf = F.linear(x, w_gu, b_gu)
        assert rel_l2(got, F.linear(F.silu(yf[:, :i]) * yf[:, i:], w_d, b_d)) < 0.05
    assert mlp(x.view(1, m, k)).shape == (1, m, k)
    with pytest.raises(ValueError, match="gate_up gives"):
        W8A8GatedMLP(gate_up, W8A8Linear.from_weight(torch.randn(k, i + 1)))


@needs_w8a8
def test_w8a8_model_runs_its_mlps_gated(tiny_model_dir: str) -> None:
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", quantization="w8a8", max_num_seqs=8))
    assert all(isinstance(layer.mlp.gated, W8A8GatedMLP) for layer in eng.runner.model.layers)


def test_kernel_inputs_checked() -> None:
    ops = w8a8_ops()
    if ops is None:
        pytest.skip(f"W8A8: {w8a8_problem()}")
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.quantize_rows(torch.randn(4, 8).double())
    with pytest.raises(RuntimeError, match="wscale must be float32 with N elements"):
        ops.dequant(torch.zeros(2, 3, dtype=torch.int32), torch.ones(2), torch.ones(4), None)
    with pytest.raises(RuntimeError, match=r"acc must be \[M, 2I\]"):
        ops.silu_mul_quant(torch.zeros(2, 3, dtype=torch.int32), torch.ones(2), torch.ones(3), None)
    with pytest.raises(RuntimeError, match="bias must be float32 with N elements"):
        ops.silu_mul_quant(torch.zeros(2, 4, dtype=torch.int32), torch.ones(2), torch.ones(4), torch.ones(3))


def test_plan_and_refusals() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        cpu_weight_plan(torch.float32, "w8a8", torch.device("cuda"))
    with pytest.raises(ValueError, match="float32"):
        cpu_weight_plan(torch.bfloat16, "w8a8", CPU)
    with pytest.raises(ValueError, match="none, int8, q4_1 or w8a8"):
        EngineConfig(quantization="w4a4")
    if w8a8_problem() is None:
        assert cpu_weight_plan(torch.float32, "w8a8", CPU) == (torch.float32, "w8a8")


def test_cpu_without_avx2_or_kernels_falls_back_to_float32_naming_why(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    # no VNNI is no refusal (oneDNN's int8 GEMM has AVX2 code); below AVX2 + FMA it is
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse2"})
    monkeypatch.setattr(kernels, "isa_level", lambda: "generic")
    with caplog.at_level(logging.WARNING):
        assert cpu_weight_plan(torch.float32, "w8a8", CPU) == (torch.float32, None)
    assert "avx2, fma, f16c" in caplog.text
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert cpu_weight_plan(torch.float32, "w8a8", CPU, cpu_kernels=False) == (torch.float32, None)
    assert "--no-cpu-kernels" in caplog.text


@needs_w8a8
def test_tiny_model_logits_and_greedy_close_to_float32(tiny_model_dir: str) -> None:
    ref = Engine(EngineConfig(model=tiny_model_dir, dtype="float32", device="cpu", max_num_seqs=8))
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", quantization="w8a8", max_num_seqs=8))
    assert eng.weight_format == "w8a8" and eng.dtype == torch.float32
    err = rel_l2(next_logits(eng, TINY_PROMPTS), next_logits(ref, TINY_PROMPTS))
    assert err < 0.12, f"w8a8 next-token logits rel L2 {err:.4f} vs float32"
    assert agreement(greedy(eng, TINY_PROMPTS, 16), greedy(ref, TINY_PROMPTS, 16)) >= 0.2


DEFAULT_MODEL_BOUND = 0.10  # the measured spread's maximum (0.075) with a third of margin


@needs_w8a8
@pytest.mark.slow
def test_default_model_close_to_float32(default_model_dir: str, isa: str) -> None:
    """SmolLM2-135M, chat prompts: next-token logits and 32 greedy tokens vs float32."""
    ref = Engine(EngineConfig(model=default_model_dir, dtype="float32", device="cpu", kv_cache_bytes=64 << 20))
    eng = Engine(EngineConfig(model=default_model_dir, device="cpu", kv_cache_bytes=64 << 20, quantization="w8a8"))
    chats = ["What is the capital of France?", "Write a haiku about rain.", "Explain what a hash table is.",
             "List three prime numbers.", "How do I boil an egg?", "Translate 'good morning' into German."]
    prompts = [ref.encode_prompt(messages=[{"role": "user", "content": c}]) for c in chats]
    got, want = next_logits(eng, prompts), next_logits(ref, prompts)
    ops = w8a8_ops()
    assert ops is not None
    err = rel_l2(got, want)
    assert err < DEFAULT_MODEL_BOUND, (f"w8a8 at ISA level {isa} (int8 GEMM {ops.gemm}): next-token logits rel L2 "
                                       f"{err:.4f} vs float32, bound {DEFAULT_MODEL_BOUND}")
    assert int((got.argmax(-1) == want.argmax(-1)).sum()) >= 4
    # teacher-forced: w8a8 reads float32's greedy text and must pick float32's next token at most
    # positions (a free-running prefix measure turns on where one near-tie first flips, so any
    # change of float32 rounding anywhere moves it; docs/benchmarks.md has the 64-prompt figure)
    want_ids = decode(ref.runner, prompts, 32)
    got_ids = decode(eng.runner, prompts, 32, forced=want_ids)
    same = sum(a == b for x, y in zip(got_ids, want_ids) for a, b in zip(x, y))
    assert same / (32 * len(prompts)) >= 0.8
