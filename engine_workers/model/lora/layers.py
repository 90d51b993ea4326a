"""The batched LoRA update inside the model's linear layers.

A step's batch is one flat ``[T, in]`` tensor whose rows belong to sequences of different adapters
(and of none: the base model). The runner hands the layers the step's rows by adapter once per
step (:class:`LoraBatch`: runs of rows per adapter slot; the engine sorts a step by adapter, so
each adapter's rows are one run). Every adapted layer computes its base output as ever and adds
its adapters' low-rank updates, in one of two forms:

* **stacked** (the default beside a base layer on the AMX tile kernel, :mod:`.tiles`): the
  step's slots' ``A`` stacked (``[sum of ranks, in]``) and their ``B`` side by side
  (``[out, sum of ranks]``), in bf16 on the tile kernel the base uses: one shrink GEMM over the
  step's adapted rows against every slot's ``A``, a mask zeroing each row's columns of the other
  slots (built once per step and column layout), one expand GEMM: two GEMMs per layer whatever the
  number of adapters, a few torch ops per layer. The extra FLOPs (every row times every slot) cost
  nothing on the tiles; the bytes are those of the slots the step uses. Rows of the base model
  outside the adapted span take no work; inside it (a direct caller's interleaved rows) their mask
  is zero.
* **segments** (every other base: float32 ``nn.Linear``, the packed oneDNN layers, the weight-only
  bf16/int8/Q4_1 layers, whose activations and outputs are float32; the update float32, exact
  against PEFT's): per adapter present, ``x[rows] @ A^T`` and ``@ B^T`` accumulated into its rows
  (punica's / S-LoRA's segments: a GEMM pair per adapter and layer, not a loop per request). With
  ``LoraBatch.grouped_max_rows`` set (``GROUPED_MAX_ROWS``; 0, off, by default: on the 2-core CPU
  it was measured on it did not beat the segments, docs/lora.md "Throughput"), a small step whose
  adapters average under two rows each takes the stacked form in float32 (torch GEMMs) instead.

W8A8 fuses the whole MLP past ``gate_up_proj`` (kernels/w8a8_linear.py), so the engine refuses LoRA
with it. ``LOCKGATE_LORA_TILES=0`` keeps the float32 segments beside an AMX base too (A/B runs).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from engine_workers.kernels.amx_linear import TileOps
from engine_workers.model.lora import tiles
from engine_workers.model.lora.adapter import LoraAdapter, LoraWeights

GROUPED_MAX_ROWS = 64  # the largest step the float32 grouped path takes, when on (decode-sized)
TILES_ENV = "LOCKGATE_LORA_TILES"  # "0": float32 adapters beside an AMX base as well


@dataclass(frozen=True, slots=True)
class Segment:
    """The rows of one adapter slot in this step's batch: a slice when contiguous, else indices."""

    slot: int
    rows: slice | torch.Tensor


@dataclass(slots=True)
class LoraBatch:
    """This step's rows by adapter, shared by every :class:`LoraLinear` of the model (set by the
    runner before each forward, cleared after): ``segments`` (per slot its rows), ``span`` (the
    rows from the first adapted to the last; None: no row has an adapter), ``used`` (the step's
    slots, sorted), ``grouped`` (the float32 layers take the stacked form this step). Each row's
    slot over the span and the masks by column layout are built on first use, once per step."""

    segments: tuple[Segment, ...] = field(default_factory=tuple)
    span: slice | None = None
    used: tuple[int, ...] = ()
    grouped: bool = False
    grouped_max_rows: int = 0  # 0: float32 layers always take the segments; GROUPED_MAX_ROWS: stacked where it applies
    runs: tuple[tuple[int, int], ...] = ()  # (slot or -1, rows) over the span
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = field(default_factory=dict)
    _row_slot: torch.Tensor | None = None

    def set(self, row_slots: Sequence[int | None], device: torch.device) -> None:
        """``row_slots``: per row of the batch, its adapter's slot, None for the base model."""
        self.set_runs([(s, 1) for s in row_slots], device)

    def set_runs(self, runs: Sequence[tuple[int | None, int]], device: torch.device) -> None:
        """``runs``: consecutive rows of one slot (None: the base model), ``(slot, count)``, in row order."""
        self.clear()
        self.device = device
        merged: list[tuple[int, int]] = []  # (slot or -1, rows), neighbours of one slot merged
        for slot, n in runs:
            s = -1 if slot is None else slot
            if n <= 0:
                continue
            if merged and merged[-1][0] == s:
                merged[-1] = (s, merged[-1][1] + n)
            else:
                merged.append((s, n))
        by_slot: dict[int, list[tuple[int, int]]] = {}  # slot -> its runs (first row, rows)
        pos = 0
        for s, n in merged:
            if s >= 0:
                by_slot.setdefault(s, []).append((pos, n))
            pos += n
        if not by_slot:
            return
        first = next(i for i, (s, _) in enumerate(merged) if s >= 0)
        last = max(i for i, (s, _) in enumerate(merged) if s >= 0)
        lo = sum(n for _, n in merged[:first])
        self.span = slice(lo, lo + sum(n for _, n in merged[first:last + 1]))
        self.runs = tuple(merged[first:last + 1])
        self.used = tuple(sorted(by_slot))
        adapted = sum(n for parts in by_slot.values() for _, n in parts)
        self.grouped = 1 < len(by_slot) and adapted < 2 * len(by_slot) and pos <= self.grouped_max_rows
        segments = []
        for slot, parts in by_slot.items():
            if len(parts) == 1:
                segments.append(Segment(slot, slice(parts[0][0], parts[0][0] + parts[0][1])))
            else:
                idx = torch.cat([torch.arange(p, p + n) for p, n in parts]).to(device)
                segments.append(Segment(slot, idx))
        self.segments = tuple(segments)

    def clear(self) -> None:
        self.segments = ()
        self.span = None
        self.used = ()
        self.grouped = False
        self.runs = ()
        self.masks.clear()
        self._row_slot = None

    @property
    def row_slot(self) -> torch.Tensor | None:
        """Each row's slot over the span (-1: the base model), or None without a span."""
        if self.span is None:
            return None
        if self._row_slot is None:
            slots = torch.tensor([s for s, _ in self.runs], dtype=torch.long)
            counts = torch.tensor([n for _, n in self.runs], dtype=torch.long)
            self._row_slot = torch.repeat_interleave(slots, counts).to(self.device)
        return self._row_slot

    def mask(self, layout: tuple[tuple[int, int], ...], cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[span rows, sum of widths]``: 1 where the column belongs to the row's slot (``layout``:
        the (slot, width) blocks of the stacked columns, ``cols`` their slot per column)."""
        m = self.masks.get(layout)
        if m is None:
            row_slot = self.row_slot
            assert row_slot is not None
            m = self.masks[layout] = (row_slot.unsqueeze(1) == cols.to(row_slot.device).unsqueeze(0)).to(dtype)
        return m


_Stack = tuple[tuple[tuple[int, int], ...], torch.Tensor, torch.Tensor, torch.Tensor]


class LoraLinear(nn.Module):
    """``base(x)`` plus each adapted row's slot's low-rank update (module docstring)."""

    def __init__(self, base: nn.Module, batch: LoraBatch, max_loras: int, tile_ops: TileOps | None = None) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.tiles = tile_ops  # the stacked bf16 form on these tiles, or None: float32
        self.in_features, self.out_features = int(getattr(base, "in_features", 0)), int(getattr(base, "out_features", 0))
        self.slots: list[LoraWeights | None] = [None] * max_loras
        self.tile_slots: list[tiles.TileSlot | None] = [None] * max_loras
        # the stacked form's weights for the step's slots (``LoraBatch.used``): (those slots, the
        # stack or None when none of them adapts this layer); rebuilt when the step's slots or a
        # slot's weights change (decode steps keep their adapters for many steps, so a rebuild is rare)
        self._tile_stack: tuple[tuple[int, ...], tiles.TileStack | None] | None = None
        self._stacked: tuple[tuple[int, ...], _Stack | None] | None = None

    def set_slot(self, slot: int, weights: LoraWeights | None) -> None:
        if self.tiles is not None:  # only the packed bf16 copy is kept
            self.tile_slots[slot] = None if weights is None else tiles.pack_slot(self.tiles, weights.a, weights.b)
        else:
            self.slots[slot] = weights
        self._tile_stack = self._stacked = None

    def _tiles_for(self, wanted: tuple[int, ...]) -> tiles.TileStack | None:
        if self._tile_stack is None or self._tile_stack[0] != wanted:
            used = [(s, t) for s in wanted if (t := self.tile_slots[s]) is not None]
            self._tile_stack = (wanted, tiles.stack(used) if used else None)
        return self._tile_stack[1]

    def _stack(self, wanted: tuple[int, ...]) -> _Stack | None:
        if self._stacked is None or self._stacked[0] != wanted:
            used = [(s, w) for s in wanted if (w := self.slots[s]) is not None]
            stack = None
            if used:
                layout = tuple((s, w.a.shape[0]) for s, w in used)
                a = torch.cat([w.a for _, w in used]).T.contiguous()
                b = torch.cat([w.b for _, w in used], dim=1).T.contiguous()
                cols = torch.cat([torch.full((r,), s, dtype=torch.long, device=a.device) for s, r in layout])
                stack = (layout, a, b, cols)
            self._stacked = (wanted, stack)
        return self._stacked[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        span = batch.span
        if span is None:  # no row of this step has an adapter
            return y
        if self.tiles is not None:  # bf16 on the tiles: two GEMMs for all the step's adapters
            st = self._tiles_for(batch.used)
            if st is not None:
                xs = x.reshape(-1, self.in_features)[span]
                mask = batch.mask(st.layout, st.cols, torch.float32)
                y.view(-1, self.out_features)[span].add_(tiles.update(self.tiles, st, xs, mask, self.out_features))
            return y
        if batch.grouped:  # float32, stacked
            fst = self._stack(batch.used)
            if fst is not None:
                layout, a, b, cols = fst
                h = x[span] @ a
                h.mul_(batch.mask(layout, cols, h.dtype))
                y[span].addmm_(h, b)
            return y
        for seg in batch.segments:
            w = self.slots[seg.slot]
            if w is None:  # the adapter leaves this layer as it is
                continue
            if isinstance(seg.rows, slice):  # a view of y's rows: the second GEMM accumulates into it
                y[seg.rows].addmm_(x[seg.rows] @ w.a.T, w.b.T)
            else:
                y.index_add_(0, seg.rows, (x.index_select(0, seg.rows) @ w.a.T) @ w.b.T)
        return y


ADAPTABLE = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def attach(model: nn.Module, num_layers: int, max_loras: int) -> tuple[LoraBatch, dict[str, LoraLinear]]:
    """Wrap every adaptable dense layer of ``model`` (a ``LlamaForPagedLM``) in a :class:`LoraLinear`
    with ``max_loras`` empty slots; returns the shared batch context and the wrappers by name."""
    batch = LoraBatch()
    wrapped: dict[str, LoraLinear] = {}
    use_tiles = os.environ.get(TILES_ENV, "") not in ("0",)
    for i in range(num_layers):
        for name in ADAPTABLE:
            parent_name, _, attr = f"layers.{i}.{name}".rpartition(".")
            try:
                parent = model.get_submodule(parent_name)
            except AttributeError:  # MLA attention, a sparse MoE block: nothing of that name
                continue
            base = getattr(parent, attr, None)
            if base is None or isinstance(base, LoraLinear):
                continue
            lin = LoraLinear(base, batch, max_loras, tiles.tile_ops(base) if use_tiles else None)
            setattr(parent, attr, lin)
            wrapped[f"layers.{i}.{name}"] = lin
    return batch, wrapped


def install(wrapped: dict[str, LoraLinear], slot: int, adapter: LoraAdapter | None, device: torch.device) -> None:
    """Put ``adapter``'s weights (None: none) into ``slot`` of every wrapped layer."""
    for name, lin in wrapped.items():
        w = adapter.layers.get(name) if adapter is not None else None
        lin.set_slot(slot, None if w is None else LoraWeights(w.a.to(device), w.b.to(device)))
