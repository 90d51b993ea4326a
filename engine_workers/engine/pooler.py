"""Embedding requests' vectors, beside the sampler: the step's postprocessing for a request whose
``SamplingParams.pooling`` is set. Such a request ends at its prefill with one L2-normalised
vector instead of a sampled token (docs/design.md, "Embeddings").

``last`` pooling reads the final-norm state of the prompt's last row, which the runner returns with
the logit rows (``ModelInput.hidden``). ``mean`` pooling needs every prompt row's state, and a long
prompt is prefilled in chunks over several steps, so the runner sums each chunk's rows
(``ModelInput.sum_chunks``) and the pooler adds the sums up until the prompt's last chunk.
Invariant: a mean-pooled request's chunks are contiguous from row 0 (it never adopts a cached
prefix, ``SamplingParams.uses_prefix_cache``); a preempted one recomputes from row 0, which starts
its sum afresh.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine_workers.engine.scheduler import ScheduledSeq
from engine_workers.engine.sequence import Sequence
from engine_workers.model.execution.batch import ModelInput


@dataclass(slots=True)
class _MeanSum:
    total: torch.Tensor  # the sum of the final-norm states of prompt rows [0, rows)
    rows: int


class Pooler:
    """Not thread-safe: owned by the engine's step."""

    def __init__(self) -> None:
        self._means: dict[str, _MeanSum] = {}

    @staticmethod
    def wants(scheduled: Seq[ScheduledSeq]) -> tuple[bool, tuple[int, ...]]:
        """What the step's forward must return for pooling: ``(hidden, sum_chunks)`` of its
        :class:`ModelInput` (the sampled rows' states when a pooling request finishes its prompt;
        the row sums of every mean-pooled request's chunk)."""
        hidden = any(item.samples and item.seq.params.pooling for item in scheduled)
        means = tuple(i for i, item in enumerate(scheduled) if item.seq.params.pooling == "mean")
        return hidden, means

    def add_sums(self, batch: ModelInput, seq_ids: Seq[str], sums: torch.Tensor) -> None:
        """The runner summed the rows of ``batch.sum_chunks`` (``seq_ids[i]`` the sequence of chunk
        ``i``): add each sum to its request's."""
        for j, i in enumerate(batch.sum_chunks):
            chunk = batch.chunks[i]
            n = len(chunk.token_ids)
            if chunk.start == 0:
                self._means[seq_ids[i]] = _MeanSum(sums[j].clone(), n)
                continue
            acc = self._means.get(seq_ids[i])
            assert acc is not None and chunk.start == acc.rows, "mean pooling missed prompt rows"
            acc.total += sums[j]
            acc.rows += n

    def vectors(self, seqs: Seq[Sequence], last_states: torch.Tensor) -> list[tuple[float, ...]]:
        """The normalised vectors of ``seqs``, pooling requests whose prompt is now computed;
        ``last_states[i]`` is the final-norm state of ``seqs[i]``'s last prompt row."""
        picked = []
        for i, seq in enumerate(seqs):
            if seq.params.pooling == "mean":
                acc = self._means.pop(seq.seq_id, None)
                assert acc is not None and acc.rows == seq.num_prompt_tokens, "mean pooling missed prompt rows"
                picked.append(acc.total / acc.rows)
            else:
                picked.append(last_states[i])
        vectors = torch.nn.functional.normalize(torch.stack(picked), dim=-1)
        return [tuple(v) for v in vectors.tolist()]

    def forget(self, seq_id: str) -> None:
        """The request ended (or was aborted) before its vector: drop its partial sum."""
        self._means.pop(seq_id, None)
