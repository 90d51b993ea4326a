"""The batched LoRA update inside the model's linear layers.

A step's batch is one flat ``[T, in]`` tensor whose rows belong to sequences of different adapters
(and of none: the base model). The runner groups the rows by adapter once per step
(:class:`LoraBatch`: per adapter slot, its rows, a slice where they are contiguous). Every adapted
layer then computes its base output as ever and adds, per adapter present, one
``x[rows] @ A^T`` and one ``@ B^T`` (punica's / S-LoRA's segments: a GEMM pair per adapter and
layer, not a loop per request). Rows of the base model take no extra work.

With ``LoraBatch.grouped_max_rows`` set (``GROUPED_MAX_ROWS``; 0, off, by default: on the
2-core CPU it was measured on it did not beat the segments, docs/lora.md "Throughput"), a small
step (at most that many rows: decode steps) whose adapters have fewer than two rows each on
average (many adapters, one or two requests each) takes the grouped path instead: each layer keeps the A and B of all its slots stacked
(``[sum of ranks, in]`` and ``[out, sum of ranks]``), computes ``x @ A_all^T`` for every row once,
zeroes each row's columns of the other slots (a mask built once per step and column layout), and
adds ``@ B_all^T`` with one GEMM: two GEMMs per layer whatever the number of adapters. It does
the GEMMs for every slot on every row (the FLOPs of all slots times the rows), so it pays only
where the segment path's cost is its op count, not its FLOPs: many adapters of one row each
(docs/lora.md, "Throughput": with 4 adapters of 4 rows each the segments were faster).

The wrapper is layer-agnostic: the base may be ``nn.Linear``, the packed oneDNN layer or a
weight-only low-precision layer (bf16, int8, Q4_1: their activations and outputs are the compute
dtype), and the update runs in the compute dtype beside it. W8A8 fuses the whole MLP past
``gate_up_proj`` (kernels/w8a8_linear.py), so the engine refuses LoRA with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine_workers.model.lora.adapter import LoraAdapter, LoraWeights

GROUPED_MAX_ROWS = 64  # the largest step the grouped path takes, when on (decode-sized)


@dataclass(frozen=True, slots=True)
class Segment:
    """The rows of one adapter slot in this step's batch: a slice when contiguous, else indices."""

    slot: int
    rows: slice | torch.Tensor


@dataclass(slots=True)
class LoraBatch:
    """This step's segments, shared by every :class:`LoraLinear` of the model (set by the runner
    before each forward, cleared after). ``row_slot``: set instead for the grouped path, each
    row's slot (-1: the base model); ``masks``: its masks by column layout, built once per step."""

    segments: tuple[Segment, ...] = field(default_factory=tuple)
    row_slot: torch.Tensor | None = None
    used: tuple[int, ...] = ()  # the grouped path's slots this step (the others are not computed)
    masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = field(default_factory=dict)
    grouped_max_rows: int = 0  # 0: always the segments; GROUPED_MAX_ROWS: the grouped path where it applies

    def set(self, row_slots: list[int | None], device: torch.device) -> None:
        """``row_slots``: per row of the batch, its adapter's slot, None for the base model."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot is not None:
                by_slot.setdefault(slot, []).append(row)
        self.masks.clear()
        adapted = sum(len(rows) for rows in by_slot.values())
        if 1 < len(by_slot) and adapted < 2 * len(by_slot) and len(row_slots) <= self.grouped_max_rows:
            self.segments = ()
            self.used = tuple(sorted(by_slot))
            self.row_slot = torch.tensor([-1 if s is None else s for s in row_slots], dtype=torch.long, device=device)
            return
        self.row_slot = None
        segments = []
        for slot, rows in by_slot.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                segments.append(Segment(slot, slice(rows[0], rows[-1] + 1)))
            else:
                segments.append(Segment(slot, torch.tensor(rows, dtype=torch.long, device=device)))
        self.segments = tuple(segments)

    def clear(self) -> None:
        self.segments = ()
        self.row_slot = None
        self.used = ()
        self.masks.clear()

    def mask(self, layout: tuple[tuple[int, int], ...], cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, sum of ranks]``: 1 where the column belongs to the row's slot (``layout``: the
        (slot, rank) blocks of the stacked columns, ``cols`` their slot per column)."""
        m = self.masks.get(layout)
        if m is None:
            assert self.row_slot is not None
            m = self.masks[layout] = (self.row_slot.unsqueeze(1) == cols.unsqueeze(0)).to(dtype)
        return m


_Stack = tuple[tuple[tuple[int, int], ...], torch.Tensor, torch.Tensor, torch.Tensor]


class LoraLinear(nn.Module):
    """``base(x)`` plus, per segment of the step, that slot's low-rank update of its rows."""

    def __init__(self, base: nn.Module, batch: LoraBatch, max_loras: int) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.slots: list[LoraWeights | None] = [None] * max_loras
        # the grouped path's stacked slots, for the step's slots (``LoraBatch.used``): (those
        # slots, (layout, A^T [in, R], B^T [R, out], slot per column) or None when none adapts
        # this layer); rebuilt when the step's slots or a slot's weights change (decode steps
        # keep their adapters for many steps, so a rebuild is rare)
        self._stacked: tuple[tuple[int, ...], _Stack | None] | None = None

    def set_slot(self, slot: int, weights: LoraWeights | None) -> None:
        self.slots[slot] = weights
        self._stacked = None

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
        if batch.row_slot is not None:  # grouped: two GEMMs for all the step's adapters
            st = self._stack(batch.used)
            if st is not None:
                layout, a, b, cols = st
                h = x @ a
                h.mul_(batch.mask(layout, cols, h.dtype))
                y.addmm_(h, b)
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
            lin = LoraLinear(base, batch, max_loras)
            setattr(parent, attr, lin)
            wrapped[f"layers.{i}.{name}"] = lin
    return batch, wrapped


def install(wrapped: dict[str, LoraLinear], slot: int, adapter: LoraAdapter | None, device: torch.device) -> None:
    """Put ``adapter``'s weights (None: none) into ``slot`` of every wrapped layer."""
    for name, lin in wrapped.items():
        w = adapter.layers.get(name) if adapter is not None else None
        lin.set_slot(slot, None if w is None else LoraWeights(w.a.to(device), w.b.to(device)))
