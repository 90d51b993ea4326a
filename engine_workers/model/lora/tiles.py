"""Adapters in bf16 on the AMX tile kernel, beside a base layer that runs there (``--dtype auto`` or
``bfloat16`` on a CPU at the ``amx`` ISA level: :class:`~engine_workers.kernels.amx_linear.AmxLinear`).

Each slot's ``A`` ``[r, in]`` and ``B`` ``[out, r]`` are packed once, when the adapter is put in its
slot, into the tile kernel's layout (``csrc/amx_bf16.cpp``: blocks of 16 output columns by 32 of K,
bf16 pairs), with ``r`` padded to a multiple of 16 by zero rows of ``A`` and zero columns of ``B``
(rank 16, 32, ... needs none). That layout concatenates without repacking:

* ``A`` stacks along its 16-column panels (the shrink's output columns): the panels of the step's
  slots one after another, plus one zero panel when their count is odd (the kernel computes 32
  columns per task);
* ``B`` stacks along K in halves of a 32-wide K block: within a block, pair index ``i < 8`` holds
  k 0-15 and ``i >= 8`` k 16-31, so the packed tensor ``[panels, K/32, 16, 16, 2]`` viewed as
  ``[panels, K/16, 8, 16, 2]`` is a sequence of 16-wide K pieces, and the slots' pieces concatenate
  along that axis (plus a zero half when their count is odd).

So a step's stacked weights are two ``torch.cat`` of views per layer, rebuilt only when the
step's set of slots changes (decode steps keep their adapters for many steps).

Numerics: the update is ``bf16(bf16(x) . bf16(A)^T) . bf16(B)^T`` summed in float32, the base's
own precision (it rounds ``x`` and its weights to bf16 the same way); docs/lora.md states the
measured difference from the float32 update. Batch invariance: a row's shrink column depends on
that row and that column of ``A`` alone (one chain of tile dot products over K), and in the expand
the row's columns of other slots are zero (the mask), so their products are exact zeros inside
the chain: the row's sum is the chain over its own slot's columns in their own order, whatever
slots and rows share the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_workers.kernels.amx_linear import AmxLinear, TileOps

PIECE = 16  # the width a slot's rank is padded to: one tile panel / half a K block


@dataclass(frozen=True, slots=True)
class TileSlot:
    """One slot's packed update: ``a`` ``[width / 16, in_pad / 32, 16, 16, 2]`` (its panels only),
    ``b`` ``[out_pad / 16, width / 16, 8, 16, 2]`` (its K halves only); ``width``: the rank padded to 16."""

    width: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True, slots=True)
class TileStack:
    """The step's slots stacked: ``a`` and ``b`` in the kernel's layout, ``n`` the shrink's output
    columns (the sum of the widths), ``layout`` (slot, width) in column order, ``cols`` each column's slot."""

    layout: tuple[tuple[int, int], ...]
    cols: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    n: int


def tile_ops(base: object) -> TileOps | None:
    """The tile kernel ``base`` runs on, or None (any other layer keeps a float32 update)."""
    return base._tiles if isinstance(base, AmxLinear) else None


def pack_slot(ops: TileOps, a: torch.Tensor, b: torch.Tensor) -> TileSlot:
    r, fan_in = a.shape
    width = -(-r // PIECE) * PIECE
    a_pad = torch.zeros(width, fan_in, dtype=torch.float32)
    a_pad[:r] = a.float()
    b_pad = torch.zeros(b.shape[0], width, dtype=torch.float32)
    b_pad[:, :r] = b.float()
    pa = ops.pack(a_pad)[: width // PIECE].clone()
    pb = ops.pack(b_pad)
    pb = pb.view(pb.shape[0], pb.shape[1] * 2, 8, PIECE, 2)[:, : width // PIECE].clone()
    return TileSlot(width, pa, pb)


def stack(used: list[tuple[int, TileSlot]]) -> TileStack:
    layout = tuple((s, t.width) for s, t in used)
    cols = torch.cat([torch.full((t.width,), s, dtype=torch.long) for s, t in used])
    a = torch.cat([t.a for _, t in used])
    if a.shape[0] % 2:
        a = torch.cat([a, torch.zeros_like(a[:1])])
    b = torch.cat([t.b for _, t in used], dim=1)
    if b.shape[1] % 2:
        b = torch.cat([b, torch.zeros_like(b[:, :1])], dim=1)
    b = b.view(b.shape[0], b.shape[1] // 2, 2 * 8, PIECE, 2)
    return TileStack(layout, cols, a, b, int(cols.numel()))


def update(ops: TileOps, st: TileStack, x: torch.Tensor, mask: torch.Tensor, out_features: int) -> torch.Tensor:
    """``[rows, out]``: each row's slot's update (``mask``: 1 on the row's own slot's columns)."""
    h = ops.linear(x.float().contiguous(), st.a, st.n, None)
    h.mul_(mask)
    return ops.linear(h, st.b, out_features, None)
