"""The Pooler beside the Sampler, and the typed step input it reads: mean sums added chunk by chunk
from row 0 (a preemption restarts them), last-row states taken as they come, vectors normalised;
ModelInput refuses sum indices outside its chunks."""

from __future__ import annotations

import pytest
import torch

from engine_workers.engine.pooler import Pooler
from engine_workers.engine.scheduler import ScheduledSeq
from engine_workers.engine.sequence import Sequence
from engine_workers.model.execution.batch import Chunk, ModelInput
from lockgate_types import SamplingParams


def _seq(seq_id: str, n: int, pooling: str | None) -> Sequence:
    return Sequence(seq_id, list(range(1, n + 1)), SamplingParams(pooling=pooling))


def test_wants_asks_for_states_only_when_a_pooling_request_finishes_its_prompt() -> None:
    gen, last, mean = _seq("g", 4, None), _seq("l", 4, "last"), _seq("m", 6, "mean")
    assert Pooler.wants([ScheduledSeq(gen, 4, True), ScheduledSeq(last, 2, False)]) == (False, ())
    assert Pooler.wants([ScheduledSeq(gen, 4, True), ScheduledSeq(last, 4, True), ScheduledSeq(mean, 3, False)]) \
        == (True, (2,))


def test_mean_sums_add_up_over_chunks_and_normalise() -> None:
    rows = torch.arange(1.0, 13.0).reshape(6, 2)  # the 6 prompt rows' final-norm states
    seq = _seq("m", 6, "mean")
    pooler = Pooler()
    first = ModelInput((Chunk([1, 2, 3, 4], 0, [0], False),), sum_chunks=(0,))
    pooler.add_sums(first, ["m"], rows[:4].sum(0, keepdim=True))
    second = ModelInput((Chunk([9], 0, [5], True), Chunk([5, 6], 4, [0], True)), hidden=True, sum_chunks=(1,))
    pooler.add_sums(second, ["other", "m"], rows[4:].sum(0, keepdim=True))
    (vec,) = pooler.vectors([seq], torch.zeros(1, 2))
    want = torch.nn.functional.normalize(rows.mean(0), dim=0)
    assert torch.allclose(torch.tensor(vec), want)


def test_a_recomputed_prompt_restarts_its_sum_and_a_gap_is_caught() -> None:
    pooler = Pooler()
    one = torch.ones(1, 2)
    pooler.add_sums(ModelInput((Chunk([1, 2], 0, [0], False),), sum_chunks=(0,)), ["m"], one * 5)
    pooler.add_sums(ModelInput((Chunk([1, 2], 0, [0], False),), sum_chunks=(0,)), ["m"], one)  # preempted: row 0 again
    pooler.add_sums(ModelInput((Chunk([3], 2, [0], True),), sum_chunks=(0,)), ["m"], one)
    (vec,) = pooler.vectors([_seq("m", 3, "mean")], torch.zeros(1, 2))
    assert torch.allclose(torch.tensor(vec), torch.nn.functional.normalize(torch.ones(2), dim=0))
    pooler.add_sums(ModelInput((Chunk([1], 0, [0], False),), sum_chunks=(0,)), ["x"], one)
    with pytest.raises(AssertionError, match="missed prompt rows"):
        pooler.add_sums(ModelInput((Chunk([3], 2, [0], True),), sum_chunks=(0,)), ["x"], one)


def test_last_pooling_normalises_the_given_state_and_forget_drops_a_sum() -> None:
    pooler = Pooler()
    (vec,) = pooler.vectors([_seq("l", 3, "last")], torch.tensor([[3.0, 4.0]]))
    assert vec == pytest.approx((0.6, 0.8))
    pooler.add_sums(ModelInput((Chunk([1, 2], 0, [0], False),), sum_chunks=(0,)), ["m"], torch.ones(1, 2))
    pooler.forget("m")
    with pytest.raises(AssertionError, match="missed prompt rows"):
        pooler.vectors([_seq("m", 2, "mean")], torch.zeros(1, 2))


def test_model_input_counts_its_rows_and_refuses_a_sum_outside_its_chunks() -> None:
    batch = ModelInput((Chunk([1, 2, 3], 0, [0], True), Chunk([4], 7, [1], False)))
    assert (batch.num_tokens, batch.num_logit_rows) == (4, 1)
    assert ModelInput(batch.chunks, every_row=True).num_logit_rows == 4
    with pytest.raises(ValueError, match="sum_chunks"):
        ModelInput(batch.chunks, sum_chunks=(2,))
