"""The grouped LoRA path (engine_workers/model/lora/layers.py): a small step with several adapters
runs two GEMMs per layer over all the slots' stacked weights with a per-row mask; its output
equals the segment path's and the per-row definition ``base(x) + x @ A^T @ B^T`` for each row's
adapter (none for base rows), with slots of different ranks, empty slots, interleaved rows, and a
slot changed between steps."""

from __future__ import annotations

import torch
from torch import nn

from engine_workers.model.lora.adapter import LoraWeights
from engine_workers.model.lora.layers import GROUPED_MAX_ROWS, LoraBatch, LoraLinear


def weights(g: torch.Generator, rank: int, fan_in: int, fan_out: int) -> LoraWeights:
    return LoraWeights(torch.randn(rank, fan_in, generator=g), torch.randn(fan_out, rank, generator=g))


def expected(base: nn.Linear, slots: list[LoraWeights | None], x: torch.Tensor, rows: list[int | None]) -> torch.Tensor:
    out = base(x)
    for i, s in enumerate(rows):
        w = slots[s] if s is not None else None
        if w is not None:
            out[i] += x[i] @ w.a.T @ w.b.T
    return out


def test_grouped_equals_segments_and_the_definition() -> None:
    g = torch.Generator().manual_seed(0)
    base = nn.Linear(24, 40, bias=False)
    rows: list[int | None] = [0, None, 2, 3, None, 0]  # interleaved, fewer than 2 rows per adapter; slot 1 empty
    x = torch.randn(len(rows), 24, generator=g)
    out = {}
    for mode, max_rows in (("grouped", GROUPED_MAX_ROWS), ("segments", 0)):
        batch = LoraBatch(grouped_max_rows=max_rows)
        lin = LoraLinear(base, batch, max_loras=4)
        g.manual_seed(1)  # the same slots in both modes
        slots = [weights(g, 4, 24, 40), None, weights(g, 8, 24, 40), weights(g, 2, 24, 40)]
        for s, w in enumerate(slots):
            lin.set_slot(s, w)
        batch.set(rows, torch.device("cpu"))
        assert batch.grouped == (mode == "grouped")
        with torch.no_grad():
            out[mode] = lin(x)
            want = expected(base, slots, x, rows)
            torch.testing.assert_close(out[mode], want, rtol=1e-5, atol=1e-5)
            # a slot changed between steps: the stacked weights follow
            slots[2] = weights(g, 3, 24, 40)
            lin.set_slot(2, slots[2])
            batch.set(rows, torch.device("cpu"))
            torch.testing.assert_close(lin(x), expected(base, slots, x, rows), rtol=1e-5, atol=1e-5)
        batch.clear()
        with torch.no_grad():
            torch.testing.assert_close(lin(x), base(x))  # no segments: the base layer alone
    torch.testing.assert_close(out["grouped"], out["segments"], rtol=1e-5, atol=1e-5)


def test_one_adapter_many_rows_per_adapter_or_a_large_step_keep_the_segments() -> None:
    assert LoraBatch().grouped_max_rows == 0  # off unless asked for
    batch = LoraBatch(grouped_max_rows=GROUPED_MAX_ROWS)
    batch.set([0, 0, None], torch.device("cpu"))
    assert not batch.grouped and len(batch.segments) == 1 and batch.span == slice(0, 2)
    batch.set([0, 0, 1, 1, None], torch.device("cpu"))  # two rows per adapter: the segments are cheaper
    assert not batch.grouped and len(batch.segments) == 2
    batch.set(list(range(40)) * 2, torch.device("cpu"))  # 80 rows > grouped_max_rows: prefill-sized
    assert not batch.grouped and len(batch.segments) == 40
    batch.set([None, 0, None, 1, None], torch.device("cpu"))
    assert batch.grouped and batch.span == slice(1, 4)  # the span: first to last adapted row
    assert batch.row_slot is not None and batch.row_slot.tolist() == [0, -1, 1]
    batch.set([None, None], torch.device("cpu"))
    assert batch.span is None and batch.row_slot is None and batch.segments == ()


def test_runs_merge_and_index_a_slot_split_in_two() -> None:
    """The runner hands the batch one run per chunk; neighbours of one slot merge into one slice,
    a slot in two places gets its rows as indices."""
    batch = LoraBatch()
    batch.set_runs([(None, 3), (2, 2), (2, 4), (0, 1), (None, 0), (2, 1), (None, 5)], torch.device("cpu"))
    assert batch.span == slice(3, 11) and batch.used == (0, 2)
    segs = {s.slot: s.rows for s in batch.segments}
    assert segs[0] == slice(9, 10)
    assert isinstance(segs[2], torch.Tensor) and segs[2].tolist() == [3, 4, 5, 6, 7, 8, 10]
    assert batch.row_slot is not None and batch.row_slot.tolist() == [2] * 6 + [0, 2]
