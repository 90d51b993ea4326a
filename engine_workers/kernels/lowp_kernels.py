"""The low-precision-weight linear kernels (``csrc/small_m_lowp.cpp``, ``--dtype bfloat16`` /
``--quantization int8`` on a CPU): their bindings, their check, and the int8 weight quantization
they (and the w8a8 mode, :mod:`engine_workers.kernels.w8a8_linear`) use.

Weights bf16 or int8 with one float32 scale per output row, activations float32. The kernels have
AVX-512 and AVX2 + FMA forms, one per ISA level the module is built for
(:mod:`engine_workers.kernels.cpu_kernels`, :func:`~engine_workers.kernels.cpu_kernels.isa_level`);
the bf16 variant on AVX512-BF16 dot products (``linear_bf16_dot``) needs ``avx512_bf16``. Without
a flag the file still compiles (plain loops instead) and passes its check;
:func:`engine_workers.kernels.cpu_linear.lowp_problem` names what is missing and the engine keeps
float32 weights there. :class:`engine_workers.kernels.cpu_linear.LowpLinear` is the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_workers.kernels import cpu_kernels as kernels

LOWP_PANEL_COLS = 96  # output columns per panel of csrc/small_m_lowp.cpp (its NR); scales are padded to it


@dataclass(frozen=True, slots=True)
class LowpOps:
    """The low-precision-weight linear kernels (``csrc/small_m_lowp.cpp``); x and y float32."""

    pack_bf16: Callable  # (weight [N, K] any float dtype) -> bf16 panels
    linear_bf16: Callable  # (x [M, K] contiguous f32, panels, N, bias or None) -> [M, N]; f32 FMAs
    linear_bf16_dot: Callable  # the same through AVX512-BF16 dot products (x rounded to bf16)
    pack_i8: Callable  # (int8 weight [N, K]) -> int8 panels
    linear_i8: Callable  # (x [M, K] contiguous f32, panels, scales [P * 96] f32, N, bias or None) -> [M, N]
    bf16_native: bool  # built with AVX512-BF16 (else linear_bf16_dot is a slow plain loop)


def lowp() -> LowpOps | None:
    """The low-precision linear kernels, or ``None`` (then :func:`lowp_problem` says why). Both are
    checked against a float32 ``F.linear`` of the dequantized weight before use."""
    return kernels._resolved("lowp", _resolve_lowp, "bf16/int8 linear kernels unavailable")


def lowp_problem() -> str | None:
    lowp()
    return kernels._state["lowp_problem"]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: ``(q [N, K] int8, scale [N] float32)`` with
    ``w ~= q * scale[:, None]``, ``scale = max|row| / 127`` (an all-zero row gets scale 1)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _check_lowp(ops: LowpOps) -> str | None:
    """Compare both kernels with ``F.linear`` of the same rounded/dequantized weight over row-tile,
    panel and k-block tails (odd K for the bf16 pairs), with and without bias."""
    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 96, 64), (7, 100, 71), (13, 200, 300), (37, 97, 130)):
        w, b, x = (torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen))
        wb, xb = w.bfloat16().float(), x.bfloat16().float()
        q, s = quantize_int8(w)
        panels, qpanels = ops.pack_bf16(w), ops.pack_i8(q)
        scales = torch.zeros(-(-n // LOWP_PANEL_COLS) * LOWP_PANEL_COLS)
        scales[:n] = s
        for bias in (None, b):
            got, want = ops.linear_bf16(x, panels, n, bias), F.linear(x, wb, bias)
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
                return f"bf16 linear kernel disagrees with F.linear at M={m} N={n} K={k}"
            got, want = ops.linear_bf16_dot(x, panels, n, bias), F.linear(xb, wb, bias)
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
                return f"bf16 dot-product linear kernel disagrees with F.linear at M={m} N={n} K={k}"
            got, want = ops.linear_i8(x, qpanels, scales, n, bias), F.linear(x, q.float() * s[:, None], bias)
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
                return f"int8 linear kernel disagrees with F.linear at M={m} N={n} K={k}"
    return None


def _resolve_lowp() -> tuple[LowpOps | None, str | None]:
    return kernels._checked(lambda m: LowpOps(m.pack_bf16, m.linear_bf16f, m.linear_bf16, m.pack_i8, m.linear_i8,
                                      bool(m.bf16_native())),
                    _check_lowp, "bf16/int8 linear kernels")
