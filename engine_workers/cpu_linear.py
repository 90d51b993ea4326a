"""CPU linear layers on oneDNN with weights packed once at load time.

Why: ``F.linear`` on CPU calls a generic sgemm that re-packs the weight matrix into its blocked
layout on every call. For decode batches (M = 1..64 rows) that repacking is the whole cost: the
30 layers of SmolLM2 take ~50 ms at M=16 through ``F.linear`` and ~21 ms through oneDNN with the
weights reordered once (its blocked layout, any M). Large M gains too (prefill chunks of 512
rows: ~650 ms -> ~270 ms on the 2-core benchmark machine), because the packed kernel reaches the
CPU's fp32 FMA peak. The figures and the command are in docs/benchmarks.md.

The kernels are PyTorch's own (``torch.ops.mkldnn``, what ``torch.compile`` uses for frozen CPU
linears), but they are not public API, so :func:`prepack_linears` checks them first: it packs a
small random layer, compares with ``F.linear`` and, if the ops are missing or disagree, logs why
and leaves the model on ``F.linear``. Results differ from ``F.linear`` only by fp32 summation order
(relative ~1e-6), the same kind of difference as any two GEMM libraries.

Only fp32 on CPU: CUDA has its own GEMMs, and on CPUs without AMX bf16 is slow either way.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


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
    kept: the packed copy replaces it)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed = packed  # plain attribute: an opaque oneDNN tensor, not a parameter
        self.bias = bias
        self._linear = _ops()[1]

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        reorder, _ = _ops()
        out_f, in_f = weight.shape
        return cls(reorder(weight.detach().contiguous(), None), None if bias is None else bias.detach(), in_f, out_f)

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "PackedLinear":
        return cls.from_weight(lin.weight, lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


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


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by a :class:`PackedLinear`, in place; returns
    how many were replaced. The caller checks :func:`packing_problem` first."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear.from_linear(child))
                replaced += 1
    return replaced
