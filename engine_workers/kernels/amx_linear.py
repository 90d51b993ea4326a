"""bf16 linear layers on AMX tiles (the ``amx`` ISA level, ``--dtype bfloat16`` or ``auto`` on a CPU).

Two ways to run them, chosen once per process (:func:`amx`, :func:`backend`):

* **the engine's tile kernel** (``csrc/amx_bf16.cpp``, built only at the amx level; the default):
  weights packed once at load into the tiles' bf16 pair layout, activations rounded to bf16 once per
  call, each output element summed by one chain of tile dot products over K in a fixed order, so a
  row's result cannot depend on the other rows, the row count or the thread split (batch-invariant by
  construction); the output is float32 straight from the float32 accumulators.
* **oneDNN's bf16 matmul** through torch (``torch.ops.mkldnn._reorder_linear_weight`` once at load,
  ``torch.ops.mkldnn._linear_pointwise`` per call), the fallback where the tile kernel is not built,
  fails its load-time check, or ``LOCKGATE_AMX_ONEDNN=1`` asks for it (A/B runs). oneDNN rounds its
  output to bf16, which the layer widens back to float32.

Either way everything outside the linear layers (norms, RoPE, attention, the KV cache, the residual
stream) stays float32 as in the other CPU weight formats. Design and figures: docs/design.md
("bf16 on AMX tiles") and docs/benchmarks.md.

Batch invariance of the oneDNN path (exact resume, docs/benchmarks-robustness.md): oneDNN picks its
AMX kernel by the row count, and above 32 rows a row's sums come out in another order than alone (a
bf16 ulp apart; measured on torch 2.15's oneDNN, 2 and 1 threads). Up to :data:`AMX_ROWS` rows every
row came out bit for bit as it does alone, at every row count and position, for every shape tried (K
up to 8192). So on oneDNN every input goes through in pieces of at most ``AMX_ROWS`` rows (about 3x
slower than one call at 1024 rows), and each distinct weight shape is checked for that at load
(:func:`shape_problem`): a shape that fails keeps the engine's own bf16 kernel (float32 activations;
:class:`engine_workers.kernels.cpu_linear.LowpLinear`), logged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_workers.kernels import cpu_kernels as kernels

log = logging.getLogger(__name__)

AMX_ROWS = 32  # the most rows per oneDNN call: up to here a row's result does not depend on the others
ONEDNN_ENV = "LOCKGATE_AMX_ONEDNN"  # "1": oneDNN in pieces instead of the engine's tile kernel
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
    """Whether bf16 linears run on AMX tiles in this process (the ``amx`` ISA level and the tile
    kernel or oneDNN's ops checked); when not, :func:`amx_problem` says why."""
    tiles()  # resolved first: _resolve runs under the kernels' lock, which is not reentrant
    return bool(kernels._resolved("amx_bf16", _resolve, "bf16 linears stay off AMX tiles"))


def amx_problem() -> str | None:
    amx()
    return kernels._state["amx_bf16_problem"]


def backend() -> str | None:
    """``"tiles"`` (the engine's tile kernel), ``"onednn"`` (oneDNN in pieces) or ``None`` (not on AMX)."""
    if not amx():
        return None
    return "tiles" if tiles() is not None else "onednn"


@dataclass(frozen=True, slots=True)
class TileOps:
    """The tile kernel (``csrc/amx_bf16.cpp``)."""

    pack: Callable  # (weight [N, K] float32 or bf16) -> packed tile blocks (int16 tensor of bf16 bits)
    linear: Callable  # (x [M, K] float32 contiguous, packed, N, bias float32 [N] or None) -> float32 [M, N]


def tiles() -> TileOps | None:
    """The tile kernel, or ``None`` (then :func:`tiles_problem` says why): built at the amx level
    only, the OS granting tile data, and checked (:func:`check_tiles`). Thread-safe, once per process."""
    return kernels._resolved("amx_tiles", _resolve_tiles, "bf16 linears on AMX stay on oneDNN")


def tiles_problem() -> str | None:
    tiles()
    return kernels._state["amx_tiles_problem"]


def tiles_kernel_problem() -> str | None:
    """:func:`tiles_problem` where the tile kernel is meant to run (the amx level, oneDNN not asked
    for), else ``None`` (``make model``'s check, :mod:`engine_workers.kernels.readiness`)."""
    if kernels.isa_level() != "amx" or os.environ.get(ONEDNN_ENV, "") not in ("", "0"):
        return None
    return tiles_problem()


def _resolve_tiles() -> tuple[TileOps | None, str | None]:
    if os.environ.get(ONEDNN_ENV, "") not in ("", "0"):
        return None, f"{ONEDNN_ENV}={os.environ[ONEDNN_ENV]}"
    level = kernels.isa_level()
    if level != "amx":
        return None, f"ISA level {level}, not amx"
    return kernels._checked(lambda m: TileOps(m.pack_amx_bf16, m.linear_amx_bf16) if m.amx_bf16_built() else None,
                            check_tiles, "AMX tile kernel")


def check_tiles(ops: TileOps | None) -> str | None:
    """Compare with a float64 product of the bf16-rounded operands over row, column and k tails,
    with and without bias (float32 sums of exact products: relative error far under 1e-5 of the
    sum of |products|), and every row of a 45-row call with the row alone, bit for bit."""
    if ops is None:
        return "the module was built without AMX tiles, or the OS refused tile data (arch_prctl XTILEDATA)"
    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 48, 40), (7, 100, 70), (45, 200, 130)):
        w, b, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
        packed = ops.pack(w)
        xd, wd = x.bfloat16().double(), w.bfloat16().double()
        scale = xd.abs() @ wd.abs().T
        for bias in (None, b):
            got = ops.linear(x, packed, n, bias)
            want = xd @ wd.T + (0 if bias is None else bias.double())
            if got.shape != want.shape or got.dtype != torch.float32 or \
                    not ((got.double() - want).abs() <= scale * 1e-5 + 1e-6).all():
                return f"AMX tile kernel disagrees with the bf16 product at M={m} N={n} K={k}"
        alone = torch.cat([ops.linear(x[r:r + 1], packed, n, None) for r in range(m)])
        if not torch.equal(alone, ops.linear(x, packed, n, None)):
            return f"AMX tile kernel: a row of a {m}-row call differs from the row alone"
    return None


def _resolve() -> tuple[bool | None, str | None]:
    level = kernels.isa_level()
    if level != "amx":
        return None, f"ISA level {level}, not amx"
    if kernels._state.get("amx_tiles") is not None:  # resolved by amx() just before
        return True, None
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
        got = AmxLinear.build(w, b, None)(x)
        if got.shape != want.shape or got.dtype != torch.float32 or not torch.allclose(got, want, rtol=1e-2, atol=2e-2):
            return None, f"oneDNN bf16 linear disagrees with F.linear at M={m} N={n} K={k}"
    why = onednn_shape_problem(64, 96)
    return (None, why) if why else (True, None)


def shape_problem(n: int, k: int) -> str | None:
    """Why an ``n x k`` weight is not batch-invariant on this process's AMX path, or ``None``: never
    on the tile kernel (by construction, and checked at load); on oneDNN,
    :func:`onednn_shape_problem`."""
    return None if tiles() is not None else onednn_shape_problem(n, k)


def onednn_shape_problem(n: int, k: int) -> str | None:
    """Why an ``n x k`` weight is not batch-invariant on oneDNN's AMX kernel at this thread count, or
    ``None``: random rows, each alone against every row count from 1 to :data:`AMX_ROWS` (row 0) and
    against one full ``AMX_ROWS``-row call (every row, every position), bit for bit. Checked once
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
    """``y = x @ W^T + b`` with ``W`` bf16 packed once for the AMX tiles, ``x`` rounded to bf16, ``y``
    float32 (the bias added in float32). Any leading shape; inference only. On the tile kernel
    (``tile_ops`` given) one call whatever the row count; on oneDNN in pieces of :data:`AMX_ROWS`
    rows (batch invariance, module docstring)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int,
                 tile_ops: TileOps | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed = packed  # plain attribute: tile blocks or an opaque oneDNN tensor, not a parameter
        self.bias = bias
        self._tiles = tile_ops
        self._linear = tile_ops.linear if tile_ops is not None else _ops()[1]

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> AmxLinear:
        return cls.build(weight, bias, tiles())

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, ops: TileOps | None) -> AmxLinear:
        """On the tile kernel ``ops``, or on oneDNN where ``None``."""
        out_f, in_f = weight.shape
        b = None if bias is None else bias.detach().float().contiguous()
        if ops is not None:
            return cls(ops.pack(weight.detach()), b, in_f, out_f, ops)
        reorder, _ = _ops()
        return cls(reorder(weight.detach().bfloat16().contiguous(), None), b, in_f, out_f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if self._tiles is not None:
            x2 = x.reshape(-1, self.in_features).float().contiguous()
            return self._linear(x2, self.packed, self.out_features, self.bias).view(*lead, self.out_features)
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
        how = "the engine's tile kernel" if self._tiles is not None else "oneDNN"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights=bfloat16 on AMX tiles ({how})")
