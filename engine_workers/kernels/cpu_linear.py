"""CPU linear layers on oneDNN with weights packed once at load time.

Why: ``F.linear`` on CPU calls a generic sgemm that re-packs the weight matrix into its blocked
layout on every call. For decode batches (M = 1..64 rows) that repacking is most of the cost, so
oneDNN with the weights reordered once (its blocked layout, any M) is much faster there. Large M
gains too (prefill chunks of 512 rows), because the packed kernel reaches the CPU's fp32 FMA peak.
The figures and the command are in docs/design-history.md ("Linear layers on CPU") and docs/benchmarks.md.

The kernels are PyTorch's own (``torch.ops.mkldnn``, what ``torch.compile`` uses for frozen CPU
linears), but they are not public API, so :func:`prepack_linears` checks them first: it packs a
small random layer, compares with ``F.linear`` and, if the ops are missing or disagree, logs why
and leaves the model on ``F.linear``. Results differ from ``F.linear`` only by fp32 summation order
(relative ~1e-6), the same kind of difference as any two GEMM libraries.

Decode-sized inputs (at most ``SMALL_M_MAX`` rows) go to the engine's own kernel instead
(``csrc/small_m_linear.cpp`` via :func:`engine_workers.kernels.cpu_kernels.small_m`), which keeps a second
copy of each weight in its own panel layout: at M = 8..32 oneDNN's kernel does not overlap reading
the weights with computing, and a decode step is mostly that (docs/benchmarks.md). Larger inputs go through it too, in pieces of
``SMALL_M_MAX`` rows, so a row's result never depends on the rest of the batch (issue #38). The copy
doubles the memory of the linear weights, so it is made only while it fits in a quarter of the
memory available at load time; ``--no-cpu-kernels`` leaves everything on oneDNN.

Low-precision weights on CPU (``--dtype bfloat16``, ``--quantization int8``): :class:`LowpLinear`
keeps only a bf16 (or int8 + per-row scale) copy of each weight in the panel layout of
``csrc/small_m_lowp.cpp`` and runs every row count through that kernel, activations float32 in and
out; :func:`cpu_weight_plan` decides, from the CPU's flags and the kernels' build, what an engine
gets and logs why when it falls back to float32 weights. docs/design-history.md, "Precision and devices".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Rows up to which the small-batch kernel is used: the largest M at which it still beat oneDNN over
# SmolLM2's layer shapes (docs/design-history.md, "Decode-sized batches").
SMALL_M_MAX = 32
# oneDNN's kernel choice as it changes a row's sums (measured on torch's bundled oneDNN, AVX-512;
# PackedLinear._onednn_invariant): a one-row input over more than ONEDNN_GEMV_K features, and
# inputs above ~1024 rows, sum in another order than 2..1024 rows do.
ONEDNN_GEMV_K = 1024
ONEDNN_ROWS_MAX = 512
PANEL_COLS = 96  # output columns per panel of the kernel's weight layout (NR in small_m_linear.cpp)


def _ops():
    """The oneDNN ops, or ``None`` where this torch build lacks them."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return mkldnn._reorder_linear_weight, mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


class PackedLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` in oneDNN's blocked layout. Inference only; any number of
    leading rows. Built from an ``nn.Linear`` by :meth:`from_linear` (the plain weight is not
    kept: the packed copy replaces it). With ``small_m`` (the kernel's ``(pack, linear)``) it also
    keeps the weight in that kernel's panels and sends 2-D inputs of at most ``SMALL_M_MAX`` rows
    there."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int,
                 panels: torch.Tensor | None = None, small_linear=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed = packed  # plain attribute: an opaque oneDNN tensor, not a parameter
        self.bias = bias
        self.panels = panels  # small_m_linear's layout of the same weight, or None
        self._small = small_linear
        self._linear = _ops()[1]

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, small_m=None) -> PackedLinear:
        reorder, _ = _ops()
        out_f, in_f = weight.shape
        w = weight.detach().contiguous()
        b = None if bias is None else bias.detach().contiguous()
        pack, linear = small_m if small_m is not None else (None, None)
        return cls(reorder(w, None), b, in_f, out_f, pack(w) if pack is not None else None, linear)

    @classmethod
    def from_linear(cls, lin: nn.Linear, small_m=None) -> PackedLinear:
        return cls.from_weight(lin.weight, lin.bias, small_m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.dim() == 2:
            # Batch invariance: every row goes through the small-batch kernel, whose result for a row
            # does not depend on the other rows (oneDNN's does: it sums in another order above 32
            # rows, ~1e-5 apart). A decode row then gets the same logits whether its step also
            # carries a prefill chunk or not, and a resumed request's re-prefilled prefix the same
            # K/V as the decode steps that first produced it; with sampling, a 1e-5 shift flipped
            # a near-tie in about 1 stream in 16 (issue #38). Larger inputs go in SMALL_M_MAX-row
            # pieces; the prefill cost is in docs/benchmarks-robustness.md.
            if x.shape[0] <= SMALL_M_MAX:
                return self._small(x.contiguous(), self.panels, self.out_features, self.bias)
            return torch.cat([self._small(c.contiguous(), self.panels, self.out_features, self.bias)
                              for c in x.split(SMALL_M_MAX)])
        if x.dim() == 2:
            return self._onednn_invariant(x)
        return self._linear(x, self.packed, self.bias, "none", [], "")

    def _onednn_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN alone (``--no-cpu-kernels``), batch-invariant: its result for a row is the same
        at every row count from 2 to about 1024, but a single row over more than ONEDNN_GEMV_K
        features takes another kernel (a split-K sum, ~3e-5 apart on SmolLM2's down projection)
        and so do large inputs over long rows. So a lone row is computed as a pair (itself twice)
        and inputs go in ONEDNN_ROWS_MAX-row pieces (issue #38;
        tests/engine_workers/test_cpu_linear.py checks the thresholds on the build that runs it)."""
        m = x.shape[0]
        if m == 1 and self.in_features > ONEDNN_GEMV_K:
            return self._linear(x.expand(2, -1).contiguous(), self.packed, self.bias, "none", [], "")[:1]
        if m <= ONEDNN_ROWS_MAX:
            return self._linear(x, self.packed, self.bias, "none", [], "")
        return torch.cat([self._linear(c, self.packed, self.bias, "none", [], "") for c in x.split(ONEDNN_ROWS_MAX)])

    def extra_repr(self) -> str:
        small = f", small-batch kernel up to {SMALL_M_MAX} rows" if self.panels is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn{small}"


def panel_bytes(weights: list[torch.Tensor]) -> int:
    """Memory the small-batch kernel's copies of ``weights`` take (rows padded to whole panels)."""
    return sum(-(-w.shape[0] // PANEL_COLS) * PANEL_COLS * w.shape[1] * 4 for w in weights)  # panels are float32


def available_memory() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes, or ``None`` where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def packing_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why packed linears cannot be used here, or ``None`` when they can (checked numerically)."""
    if device.type != "cpu" or dtype != torch.float32:
        return f"only for float32 on CPU (have {dtype} on {device.type})"
    if _ops() is None:
        return "this torch build has no oneDNN linear ops"
    try:
        gen = torch.Generator().manual_seed(0)
        w, b = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
        x = torch.randn(5, 40, generator=gen)
        got = PackedLinear.from_weight(w, b)(x)
    except RuntimeError as exc:
        return f"oneDNN linear failed: {exc}"
    want = F.linear(x, w, b)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        return "oneDNN linear disagrees with F.linear"
    return None


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by ``make(it)``, in place; returns how many were
    replaced. The one loop behind every CPU weight format (packed, low-precision, W8A8)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))
                replaced += 1
    return replaced


def prepack_linears(model: nn.Module, small_m=None) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by a :class:`PackedLinear`, in place; returns
    how many were replaced. The caller checks :func:`packing_problem` first. ``small_m``: the
    small-batch kernel's ``(pack, linear)`` (:func:`engine_workers.kernels.cpu_kernels.small_m`), or None."""
    return replace_linears(model, lambda lin: PackedLinear.from_linear(lin, small_m))


# -- low-precision weights ---------------------------------------------------------------------------

QUANTIZATIONS = ("none", "int8", "q4_1", "w8a8")  # --quantization values
# bf16 weights through AVX512-BF16 dot products (x rounded to bf16) instead of widening each bf16
# pair to float32 in registers and using FMAs. Off: on the benchmark machine (Xeon with
# avx512_bf16, no AMX) the dot-product kernel was no faster at 1-2 rows and 1.4-1.5x slower at
# 8-64 (docs/design-history.md, "Precision and devices"); kept, checked, for CPUs where it is faster.
BF16_DOT_PRODUCTS = False


def cpu_weight_plan(dtype: torch.dtype, quantization: str, device: torch.device,
                    cpu_kernels: bool = True) -> tuple[torch.dtype, str | None]:
    """``(compute dtype, low-precision weight kind or None)`` for an engine asked for ``dtype`` and
    ``quantization`` on ``device``. On a CPU, ``bfloat16`` means bf16 *weights* in the linear
    layers with float32 everywhere else (norms, RoPE, attention, KV cache, activations), so the
    compute dtype is float32 and the kind ``"bfloat16"``; ``int8`` likewise (weight-only, per
    output row), ``q4_1`` (Q4_1 blocks of 32 weights, head Q8_0; :mod:`engine_workers.kernels.cpu_blocks`) and
    ``w8a8`` (int8 weights and int8 activations per row; :mod:`engine_workers.kernels.w8a8_linear`).
    Where the kernels cannot serve that (a CPU without AVX2 + FMA, no build, ``--no-cpu-kernels``)
    it logs a warning naming the reason and returns float32 weights. Raises ``ValueError`` for what
    is never supported: an unknown quantization, int8/q4_1/w8a8 on CUDA or with a non-float32 dtype."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if quantization != "none":
        what = {"int8": "weight-only int8", "q4_1": "4-bit Q4_1 blocks", "w8a8": "int8 weights and activations"}[quantization]
        if device.type != "cpu":
            raise ValueError(f"--quantization {quantization} ({what}) is implemented for CPU only; "
                             f"device is {device.type}")
        if dtype != torch.float32:
            raise ValueError(f"--quantization {quantization} computes outside the linear layers in float32; "
                             f"use --dtype auto or float32, not {dtype}")
    if device.type != "cpu" or (dtype != torch.bfloat16 and quantization == "none"):
        return dtype, None
    kind = "bfloat16" if quantization == "none" else quantization
    why = lowp_problem(kind, cpu_kernels)
    if why is not None:
        log.warning("%s weights on CPU unavailable (%s): linear weights stay float32", kind, why)
        return torch.float32, None
    return torch.float32, kind


def lowp_problem(kind: str, cpu_kernels: bool = True) -> str | None:
    """Why the ``kind`` (``"bfloat16"``, ``"int8"``, ``"q4_1"`` or ``"w8a8"``) weight kernel cannot run here, or ``None``."""
    from engine_workers.kernels import cpu_kernels as kernels
    from engine_workers.kernels import lowp_kernels

    if not cpu_kernels:
        return "needs the engine's CPU kernels, turned off by --no-cpu-kernels"
    if kind == "w8a8":  # its own kernels (and oneDNN's int8 GEMM)
        from engine_workers.kernels.w8a8_linear import w8a8_problem

        return w8a8_problem()
    slow = kernels.fast_isa_problem(kind)  # below AVX2 + FMA: plain loops, far slower than float32
    if slow is not None:
        return slow
    if kind == "bfloat16" and kernels.isa_level() == "amx" and "amx_bf16" in kernels.cpu_flags():
        from engine_workers.kernels.amx_linear import amx

        if amx():  # AMX tiles (bf16_layer); a shape oneDNN's fails falls back to the kernel below
            return None
    flags = kernels.cpu_flags()
    if kind == "q4_1":
        from engine_workers.kernels.cpu_blocks import block_problem

        return block_problem()
    if kind == "bfloat16" and BF16_DOT_PRODUCTS and flags and "avx512_bf16" not in flags:
        return "this CPU lacks the avx512_bf16 flag (AVX512-BF16 dot products) the bf16 kernel needs"
    ops = lowp_kernels.lowp()
    if ops is None:
        return lowp_kernels.lowp_problem()
    if kind == "bfloat16" and BF16_DOT_PRODUCTS and not ops.bf16_native:
        return "the kernels were built without AVX512-BF16 (compiler or CPU lacks avx512_bf16)"
    return None


def bf16_layer(weight: torch.Tensor, bias: torch.Tensor | None, lowp_ops: Any = None) -> nn.Module:
    """The ``--dtype bfloat16`` layer of ``weight`` on this CPU: on AMX tiles (the engine's tile kernel
    or oneDNN, bf16 activations; :class:`engine_workers.kernels.amx_linear.AmxLinear`) at the ``amx`` ISA level
    where its shape passes the batch-invariance check, else :class:`LowpLinear` (float32
    activations), with a warning where AMX was meant."""
    from engine_workers.kernels import amx_linear

    if amx_linear.amx():
        why = amx_linear.shape_problem(*weight.shape)
        if why is None:
            return amx_linear.AmxLinear.from_weight(weight, bias)
        log.warning("bf16 layer off AMX tiles (engine's bf16 kernel instead, float32 activations): %s", why)
    return LowpLinear.from_weight("bfloat16", weight, bias, lowp_ops)


def auto_cpu_dtype(quantization: str, cpu_kernels: bool = True) -> tuple[torch.dtype, str]:
    """``--dtype auto`` on a CPU: ``(dtype, why)``, the fastest mode measured accurate on this kind
    of host (docs/benchmarks.md, "Which mode runs where"). With AMX (the ``amx`` ISA level, its bf16
    GEMMs checked): ``bfloat16`` (bf16 linears on AMX tiles, perplexity within 0.5 % of
    float32, several times float32's GEMM speed); elsewhere ``float32`` (without AMX bf16 arithmetic
    is slower than float32 FMAs, and bf16 weights alone gained ~10 %). A quantization keeps
    float32 (it computes outside the linears in float32)."""
    if quantization != "none":
        return torch.float32, f"--quantization {quantization} computes outside the linear layers in float32"
    if not cpu_kernels:
        return torch.float32, "--no-cpu-kernels: oneDNN float32 linears"
    from engine_workers.kernels.amx_linear import amx, amx_problem, backend

    if amx():
        how = "the engine's tile kernel" if backend() == "tiles" else "oneDNN's AMX kernel"
        return torch.bfloat16, f"AMX tiles: bf16 linears on {how}, the fastest accurate CPU mode here"
    return torch.float32, f"no bf16 on AMX tiles ({amx_problem()}): without AMX bf16 arithmetic does not pay"


def auto_kv_cache_dtype(kv_cache_dtype: str, weight_kind: str | None) -> tuple[str, str | None]:
    """``--kv-cache-dtype auto`` on a CPU whose linears run bf16 on AMX tiles (``--dtype auto`` on an
    AMX host, or ``bfloat16`` there): ``("bfloat16", why)``, K/V stored as bf16 as the layers' bf16
    mode implies (vLLM's ``auto``: the model's dtype). Decode attention is memory-bound and reads
    every context token's K/V in every layer each step, so half the bytes cut its time by a third
    on the bench workload, and the perplexity stays within the accuracy bar (docs/benchmarks.md,
    "bf16 on AMX tiles"). Anything else: ``(kv_cache_dtype, None)``, unchanged."""
    if kv_cache_dtype != "auto" or weight_kind != "bfloat16":
        return kv_cache_dtype, None
    from engine_workers.kernels.amx_linear import amx

    if not amx():
        return kv_cache_dtype, None
    return "bfloat16", "bf16 linears on AMX tiles: K/V stored as bf16 (half the bytes decode attention reads)"


class LowpLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` stored as bf16 or as int8 with one float32 scale per output
    row, in ``csrc/small_m_lowp.cpp``'s panels; ``x`` and ``y`` float32, any leading shape.
    Inference only. Built by :meth:`from_weight` (the float weight is not kept)."""

    def __init__(self, kind: str, panels: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None,
                 in_features: int, out_features: int, ops: Any) -> None:
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.panels, self.scales, self.bias = panels, scales, bias  # plain attributes: not parameters
        self._ops = ops

    @classmethod
    def from_weight(cls, kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    ops: Any = None) -> LowpLinear:
        from engine_workers.kernels import lowp_kernels

        ops = ops if ops is not None else lowp_kernels.lowp()
        if ops is None:
            raise RuntimeError(f"low-precision linear kernels unavailable: {lowp_kernels.lowp_problem()}")
        out_f, in_f = weight.shape
        b = None if bias is None else bias.detach().float().contiguous()
        if kind == "bfloat16":
            return cls(kind, ops.pack_bf16(weight.detach()), None, b, in_f, out_f, ops)
        if kind == "int8":
            q, s = lowp_kernels.quantize_int8(weight)
            scales = torch.zeros(-(-out_f // lowp_kernels.LOWP_PANEL_COLS) * lowp_kernels.LOWP_PANEL_COLS)
            scales[:out_f] = s
            return cls(kind, ops.pack_i8(q), scales, b, in_f, out_f, ops)
        raise ValueError(f"unknown low-precision weight kind {kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        x2 = x2.contiguous()
        if self.kind == "bfloat16":
            linear = self._ops.linear_bf16_dot if BF16_DOT_PRODUCTS else self._ops.linear_bf16
            y = linear(x2, self.panels, self.out_features, self.bias)
        else:
            y = self._ops.linear_i8(x2, self.panels, self.scales, self.out_features, self.bias)
        return y.view(*lead, self.out_features)

    def weight_bytes(self) -> int:
        return self.panels.numel() * self.panels.element_size() + (0 if self.scales is None else self.scales.numel() * 4)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights={self.kind}")
