"""bf16 linear layers on AMX tiles (the ``amx`` ISA level, ``--dtype bfloat16`` or ``auto`` on a CPU).

What runs: oneDNN's bf16 matmul through torch (``torch.ops.mkldnn._reorder_linear_weight`` once at
load, ``torch.ops.mkldnn._linear_pointwise`` per call; the ops :mod:`engine_workers.kernels.cpu_linear`
uses in float32), which on a CPU with ``amx_bf16`` runs on the AMX tiles. Activations are rounded to
bf16 on the way in, the tiles sum in float32, oneDNN rounds the output to bf16 and the layer widens
it back to float32, so everything outside the linear layers (norms, RoPE, attention, the KV cache,
the residual stream) stays float32 as in the other CPU weight formats. Why oneDNN and not a tile
kernel of our own, and the figures: docs/design.md ("bf16 on AMX tiles") and docs/benchmarks.md.

Batch invariance (exact resume, docs/benchmarks-robustness.md): oneDNN picks its AMX kernel by the
row count, and above 32 rows a row's sums come out in another order than alone (a bf16 ulp apart;
measured on torch 2.15's oneDNN, 2 and 1 threads). Up to :data:`AMX_ROWS` rows every row came out
bit for bit as it does alone, at every row count and position, for every shape tried (K up to 8192).
So every input goes through in pieces of at most ``AMX_ROWS`` rows, and each distinct weight shape is
checked for that at load (:func:`shape_problem`): a shape that fails keeps the engine's own bf16
kernel (float32 activations; :class:`engine_workers.kernels.cpu_linear.LowpLinear`), logged.
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

from engine_workers.kernels import cpu_kernels as kernels

log = logging.getLogger(__name__)

AMX_ROWS = 32  # the most rows per oneDNN call: up to here a row's result does not depend on the others
_shape_checks: dict[tuple[int, int, int], str | None] = {}  # (N, K, threads) -> problem or None
_shape_lock = threading.Lock()


def _ops():
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return mkldnn._reorder_linear_weight, mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


def amx() -> bool:
    """Whether bf16 linears run on AMX tiles in this process (the ``amx`` ISA level, oneDNN's ops
    present, not capped below AMX, and checked); when not, :func:`amx_problem` says why."""
    return bool(kernels._resolved("amx_bf16", _resolve, "bf16 linears stay off AMX tiles"))


def amx_problem() -> str | None:
    amx()
    return kernels._state["amx_bf16_problem"]


def _resolve() -> tuple[bool | None, str | None]:
    level = kernels.isa_level()
    if level != "amx":
        return None, f"ISA level {level}, not amx"
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if capped and capped != "ALL" and "AMX" not in capped:
        return None, f"ONEDNN_MAX_CPU_ISA={capped} keeps oneDNN off the AMX tiles"
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if is_amx is not None and not is_amx():
        return None, "torch's oneDNN does not see AMX tiles on this CPU"
    if _ops() is None:
        return None, "this torch build has no oneDNN linear ops"
    try:
        return _check()
    except RuntimeError as exc:
        return None, f"oneDNN bf16 linear failed: {exc}"


def _check() -> tuple[bool | None, str | None]:
    """Compare with ``F.linear`` in float32 of the bf16-rounded operands (the tiles sum in float32;
    the output is rounded to bf16: a relative 2^-8), over tails of rows and columns, with bias."""
    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 48, 40), (7, 100, 70), (45, 200, 130)):
        w, b, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
        want = F.linear(x.bfloat16().float(), w.bfloat16().float(), b)
        got = AmxLinear.from_weight(w, b)(x)
        if got.shape != want.shape or got.dtype != torch.float32 or not torch.allclose(got, want, rtol=1e-2, atol=2e-2):
            return None, f"oneDNN bf16 linear disagrees with F.linear at M={m} N={n} K={k}"
    why = shape_problem(64, 96)
    return (None, why) if why else (True, None)


def shape_problem(n: int, k: int) -> str | None:
    """Why an ``n x k`` weight is not batch-invariant on oneDNN's AMX kernel at this thread count,
    or ``None``: random rows, each alone against every row count from 1 to :data:`AMX_ROWS` (row 0)
    and against one full ``AMX_ROWS``-row call (every row, every position), bit for bit. Checked once
    per shape and thread count in a process (about 2 * AMX_ROWS calls)."""
    key = (n, k, torch.get_num_threads())
    with _shape_lock:
        if key not in _shape_checks:
            _shape_checks[key] = _check_shape(n, k)
        return _shape_checks[key]


def _check_shape(n: int, k: int) -> str | None:
    reorder, linear = _ops()
    gen = torch.Generator().manual_seed(n * 7919 + k)
    packed = reorder(torch.randn(n, k, generator=gen).bfloat16(), None)
    x = torch.randn(AMX_ROWS, k, generator=gen).bfloat16()
    alone = [linear(x[r:r + 1].contiguous(), packed, None, "none", [], "") for r in range(AMX_ROWS)]
    full = linear(x, packed, None, "none", [], "")
    for r in range(AMX_ROWS):
        if not torch.equal(full[r:r + 1], alone[r]):
            return f"{n}x{k} weight: row {r} of a {AMX_ROWS}-row call differs from the row alone"
    for m in range(2, AMX_ROWS):
        if not torch.equal(linear(x[:m].contiguous(), packed, None, "none", [], "")[:1], alone[0]):
            return f"{n}x{k} weight: row 0 of a {m}-row call differs from the row alone"
    return None


class AmxLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` bf16 in oneDNN's AMX layout (packed once), ``x`` rounded to
    bf16, ``y`` float32 (the bias added in float32). Any leading shape; inference only. Inputs go
    through in pieces of :data:`AMX_ROWS` rows (batch invariance, module docstring)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed = packed  # plain attribute: an opaque oneDNN tensor, not a parameter
        self.bias = bias
        self._linear = _ops()[1]

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> AmxLinear:
        reorder, _ = _ops()
        out_f, in_f = weight.shape
        b = None if bias is None else bias.detach().float().contiguous()
        return cls(reorder(weight.detach().bfloat16().contiguous(), None), b, in_f, out_f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xb = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if xb.shape[0] <= AMX_ROWS:
            y = self._linear(xb, self.packed, None, "none", [], "").float()
        else:
            y = torch.empty(xb.shape[0], self.out_features)
            for i in range(0, xb.shape[0], AMX_ROWS):
                y[i:i + AMX_ROWS] = self._linear(xb[i:i + AMX_ROWS], self.packed, None, "none", [], "")
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, self.out_features)

    def weight_bytes(self) -> int:
        return self.out_features * self.in_features * 2

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights=bfloat16 on AMX tiles (oneDNN)")
