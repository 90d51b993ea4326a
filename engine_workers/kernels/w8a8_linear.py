"""W8A8 linear layers on CPU (``--quantization w8a8``): int8 weights and int8 activations, int32 sums.

Why: on CPUs with AVX512-VNNI an int8 dot-product instruction does four times the multiply-adds of a
float32 FMA, and torch's int8 GEMM (``torch._int_mm``, oneDNN underneath) reaches that rate at the
prefill shapes where the engine is compute-bound; the weights are also a quarter of float32's bytes
for decode. float32 (or bf16 dot products where the CPU runs them at half the FMA rate) cannot get
there. The figures are in docs/benchmarks.md ("Issue #23: every precision mode ...").

Numerics: the weight is the int8 weight-only mode's (symmetric, one float32 scale per output row,
:func:`engine_workers.kernels.lowp_kernels.quantize_int8`); each input row ("token") is quantized
on the fly the same way (scale = max|row| / 127, round half to even), so the int32 sums are exact
and ``y = acc * xscale[m] * wscale[n] + bias``. The error beyond int8 weights is the rounding of
each activation to 1/254 of its row's largest magnitude. Everything outside the linear layers
(embeddings, norms, RoPE, attention, KV cache, sampling) stays float32.

The two elementwise passes around the GEMM are the engine's kernels (``csrc/int8_act.cpp``); the
whole layer is checked against :func:`reference` at first use, and :func:`w8a8_problem` says why
the mode cannot run where it cannot (then the engine keeps float32 weights and logs the reason).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_workers.kernels import cpu_kernels as kernels
from engine_workers.kernels.lowp_kernels import quantize_int8


@dataclass(frozen=True, slots=True)
class W8A8Ops:
    """The elementwise kernels of ``csrc/int8_act.cpp`` and the int8 GEMM: oneDNN's
    (``torch._int_mm``) at the avx512 ISA level, ``csrc/int8_gemm.cpp``'s at avx2, where oneDNN's
    AVX2 code (``vpmaddubsw``) saturates its int16 pair sums and so is not exact."""

    quantize_rows: Callable  # (x [M, K] contiguous f32) -> (int8 [M, K], scale [M] f32)
    dequant: Callable  # (acc [M, N] int32, xscale [M], wscale [N], bias [N] or None) -> [M, N] f32
    # (acc [M, 2I] int32, xscale [M], wscale [2I], bias [2I] or None) -> quantize_rows(silu(gate) * up)
    silu_mul_quant: Callable
    pack_weight: Callable  # (int8 weight [N, K]) -> the GEMM's weight operand, made once per layer
    int_mm: Callable  # (xq [M, K] int8 contiguous, operand, N) -> exact int32 sums [M, N]
    gemm: str  # which GEMM: "oneDNN" or "int8_gemm (AVX2)"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference per-row int8 quantization, the same rule as ``csrc/int8_act.cpp``."""
    amax = x.abs().amax(dim=1)
    # floored at float32's smallest normal, as the kernel: a subnormal scale has no finite inverse
    scale = torch.where(amax > 0, (amax / 127.0).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    return torch.round(x * (1.0 / scale)[:, None]).clamp_(-127, 127).to(torch.int8), scale


def reference(x: torch.Tensor, q: torch.Tensor, wscale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``W8A8Linear``'s output computed with torch ops only (int64 sums: exact)."""
    xq, xs = quantize_rows(x)
    y = (xq.long() @ q.long().t()).double() * xs.double()[:, None] * wscale.double()[None, :]
    return (y if bias is None else y + bias.double()).float()


def w8a8_ops() -> W8A8Ops | None:
    """The kernels, checked, or ``None`` (then :func:`w8a8_problem` says why)."""
    return kernels._resolved("w8a8", _resolve, "W8A8 linear layers unavailable")


def w8a8_problem() -> str | None:
    """Why ``--quantization w8a8`` cannot run here, or ``None`` (``--no-cpu-kernels`` is checked by
    the caller, :func:`engine_workers.kernels.cpu_linear.lowp_problem`)."""
    # no VNNI is no refusal: at the avx2 level the GEMM is csrc/int8_gemm.cpp's (vpmaddwd on int16,
    # exact) and the elementwise kernels have avx2 forms (docs/design-history.md, ISA levels)
    slow = kernels.fast_isa_problem("w8a8")
    if slow is not None:
        return slow
    return w8a8_kernel_problem()


def w8a8_kernel_problem() -> str | None:
    """Why the kernels cannot build or disagree with :func:`reference`, or ``None``, whatever the
    CPU's flags: without VNNI they still run correctly, only slower than float32, so that is
    :func:`w8a8_problem`'s concern, not the build's."""
    if not hasattr(torch, "_int_mm"):
        return "this torch build has no torch._int_mm (int8 GEMM)"
    w8a8_ops()
    return kernels._state["w8a8_problem"]


def _check(ops: W8A8Ops) -> str | None:
    """The whole layer against :func:`reference` over odd shapes, with and without bias; the int32
    sums are exact, so only the float32 scaling may differ (relative ~1e-6)."""
    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 96, 64), (7, 100, 71), (37, 97, 130), (300, 33, 17)):
        w, b, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
        x[0] = 0.0  # an all-zero row: scale 1, zeros
        q, s = quantize_int8(w)
        xq, xs = ops.quantize_rows(x)
        rq, rs = quantize_rows(x)
        if not torch.equal(xq, rq) or not torch.allclose(xs, rs, rtol=1e-6, atol=0):
            return f"row quantization kernel disagrees with torch at M={m} K={k}"
        acc = ops.int_mm(xq, ops.pack_weight(q), n)
        if not torch.equal(acc, xq.long().matmul(q.long().t()).int()):  # exact sums or nothing
            return f"int8 GEMM ({ops.gemm}) is not exact at M={m} N={n} K={k}"
        for bias in (None, b):
            got = ops.dequant(acc, xs, s, bias)
            if not torch.allclose(got, reference(x, q, s, bias), rtol=1e-5, atol=1e-5):
                return f"W8A8 linear disagrees with its reference at M={m} N={n} K={k}"
    for m, i, k in ((1, 48, 64), (19, 50, 33)):
        w, b, x = torch.randn(2 * i, k, generator=gen), torch.randn(2 * i, generator=gen), torch.randn(m, k, generator=gen)
        q, s = quantize_int8(w)
        xq, xs = ops.quantize_rows(x)
        acc = ops.int_mm(xq, ops.pack_weight(q), 2 * i)
        for bias in (None, b):
            y = ops.dequant(acc, xs, s, bias)
            wq, ws = ops.quantize_rows(F.silu(y[:, :i]) * y[:, i:])
            gq, gs = ops.silu_mul_quant(acc, xs, s, bias)
            # one rounding step apart at most: expf in a vector loop vs torch's silu
            if (gq.int() - wq.int()).abs().max() > 1 or not torch.allclose(gs, ws, rtol=1e-5, atol=0):
                return f"W8A8 gated hand-off disagrees with dequant, silu * up, quantize at M={m} I={i}"
    return None


def _onednn_mm(xq: torch.Tensor, qt: torch.Tensor, n: int) -> torch.Tensor:  # noqa: ARG001 (int8_mm's signature)
    return torch._int_mm(xq, qt)


def _ops_of(m: Any) -> W8A8Ops:
    if kernels.isa_level() == "avx2":
        return W8A8Ops(m.quantize_rows_i8, m.dequant_i32, m.silu_mul_quant_i32, m.pack_i8_pairs, m.int8_mm,
                       "int8_gemm (AVX2)")
    # the (K, N) operand torch._int_mm takes: a view, oneDNN reads it transposed
    return W8A8Ops(m.quantize_rows_i8, m.dequant_i32, m.silu_mul_quant_i32, lambda q: q.t(), _onednn_mm, "oneDNN")


def _resolve() -> tuple[W8A8Ops | None, str | None]:
    return kernels._checked(_ops_of, _check, "W8A8 kernels")


class W8A8Linear(nn.Module):
    """``y = x @ W^T + b`` with W int8 (per-row scales) and x quantized per row on each call; ``x``
    and ``y`` float32, any leading shape. Inference only. Built by :meth:`from_weight`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, ops: W8A8Ops) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.q, self.scale, self.bias = q, scale, bias  # plain attributes: not parameters
        self._qt = ops.pack_weight(q)  # the GEMM's weight operand (oneDNN: a transposed view of q)
        self._ops = ops

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    ops: W8A8Ops | None = None) -> W8A8Linear:
        ops = ops if ops is not None else w8a8_ops()
        if ops is None:
            raise RuntimeError(f"W8A8 kernels unavailable: {w8a8_problem()}")
        q, s = quantize_int8(weight)
        return cls(q, s.contiguous(), None if bias is None else bias.detach().float().contiguous(), ops)

    def quantized_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (any leading shape) as the int8 rows and their scales this layer's GEMM takes."""
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        return self._ops.quantize_rows(x2.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = self.quantized_input(x)
        y = self._ops.dequant(self._ops.int_mm(xq, self._qt, self.out_features), xs, self.scale, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        packed = 0 if self._qt.data_ptr() == self.q.data_ptr() else self._qt.numel()  # int8_gemm's own panels
        return self.q.numel() + packed + self.scale.numel() * 4

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                "weights=int8, activations=int8 per row")


class W8A8GatedMLP:
    """``down(silu(gate) * up)`` over two W8A8 layers, the model's MLP (``MLP.gated``): the gate|up
    GEMM's int32 sums go straight to the down GEMM's int8 input in one pass
    (``silu_mul_quant``) instead of a float32 tensor, a gating pass and a quantize pass. The same
    arithmetic as the three layers' ops in sequence (checked at first use); ``x`` and the result
    float32, any leading shape."""

    __slots__ = ("gate_up", "down", "_ops")

    def __init__(self, gate_up: W8A8Linear, down: W8A8Linear) -> None:
        if gate_up.out_features != 2 * down.in_features:
            raise ValueError(f"gate_up gives {gate_up.out_features} features, down takes 2 x {down.in_features}")
        self.gate_up, self.down, self._ops = gate_up, down, gate_up._ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gu, dn = self.gate_up, self.down
        xq, xs = gu.quantized_input(x)
        hq, hs = self._ops.silu_mul_quant(self._ops.int_mm(xq, gu._qt, gu.out_features), xs, gu.scale, gu.bias)
        y = self._ops.dequant(self._ops.int_mm(hq, dn._qt, dn.out_features), hs, dn.scale, dn.bias)
        return y.view(*x.shape[:-1], dn.out_features)
