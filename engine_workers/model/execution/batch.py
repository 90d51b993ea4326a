"""What the engine hands the model runner for one step, and what comes back.

``ModelInput`` is the step's batch as the runner needs it, derived from the scheduler's decision
(which tokens of which sequences) and the KV manager's (which blocks): no torch tensors, so it can
be broadcast to tensor-parallel ranks (:mod:`engine_workers.model.execution.parallel.step`) or planned for
a CUDA graph (:mod:`engine_workers.model.execution.cudagraph.buckets`) before anything runs. ``RunnerOutput``
is everything the forward produced that the engine's postprocessing (sampler, pooler) reads. The
anchors: vLLM v1's ``SchedulerOutput`` -> ``ModelRunnerOutput`` and nano-vllm's ``LLMEngine.step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class Chunk(NamedTuple):
    """One sequence's share of a step. A named tuple rather than a dataclass because the CUDA-graph
    planner and the tensor-parallel step codec unpack it positionally (``tokens, start, blocks,
    samples``); it is immutable and typed either way."""

    token_ids: list[int]  # the tokens computed this step
    start: int  # how many of the sequence's tokens were computed before: the first position
    block_ids: list[int]  # the sequence's block table
    samples: bool  # the chunk reaches the end of the known tokens: its last row's logits are wanted


@dataclass(frozen=True, slots=True)
class ModelInput:
    """One forward. Logit rows: the last row of each chunk with ``samples``, in chunk order (with
    ``every_row``, every row of the batch instead: perplexity, ``benchmarks/engine/accuracy.py``).

    ``hidden``: also return those rows' final-norm states (last-token pooling reads them).
    ``sum_chunks``: indices into ``chunks`` whose every row's final-norm state is summed (mean
    pooling adds the sums chunk by chunk). Both need the eager path: a step asking for either is
    never replayed from a CUDA graph.

    ``verify``: indices into ``chunks`` of speculative verification chunks (a decode token and the
    tokens proposed after it): every row of such a chunk is a logit row, and every row attends as
    a decode row of its own position (the same attention path, bit for bit, as plain decoding of
    that position: engine.core, "Speculative decoding"). Never replayed from a CUDA graph.
    ``replay``: indices into ``chunks`` of replay chunks, output tokens sampled before and computed
    again (a resumed or preempted request, engine.scheduler): every row attends as a decode row of
    its own position, as when the token was first fed; the logit rows are the usual ones (the last
    row, when the chunk samples). Never replayed from a CUDA graph.
    ``prefill``: indices into ``chunks`` of one-token chunks of *prompt* positions (a prompt's last
    token after a prefix-cache hit or a chunked prefill): attended as a prefill row, as that
    position is when its prompt is computed in one piece; any other one-token chunk is a decode
    row (docs/design-history.md, Scheduling). Never replayed from a CUDA graph.
    ``loras``: per chunk, its LoRA adapter's name (None: the base model); empty = all base
    (:mod:`engine_workers.model.lora`)."""

    chunks: tuple[Chunk, ...]
    every_row: bool = False
    hidden: bool = False
    sum_chunks: tuple[int, ...] = ()
    verify: tuple[int, ...] = ()
    replay: tuple[int, ...] = ()
    prefill: tuple[int, ...] = ()
    loras: tuple[str | None, ...] = ()
    states: bool = False  # also return every row's last hidden state before the final norm (MTP)

    def __post_init__(self) -> None:
        if self.loras and len(self.loras) != len(self.chunks):
            raise ValueError(f"loras has {len(self.loras)} entries for {len(self.chunks)} chunks")
        if not all(0 <= i < len(self.chunks) for i in self.sum_chunks):
            raise ValueError(f"sum_chunks {self.sum_chunks} name chunks outside [0, {len(self.chunks)})")
        if not all(0 <= i < len(self.chunks) and self.chunks[i].samples for i in self.verify):
            raise ValueError(f"verify {self.verify} must name sampling chunks in [0, {len(self.chunks)})")
        if not all(0 <= i < len(self.chunks) for i in self.replay) or set(self.replay) & set(self.verify):
            raise ValueError(f"replay {self.replay} must name chunks in [0, {len(self.chunks)}) that verify does not")
        if not all(0 <= i < len(self.chunks) and len(self.chunks[i].token_ids) == 1 for i in self.prefill) \
                or set(self.prefill) & self.decode_rows:
            raise ValueError(f"prefill {self.prefill} must name one-token chunks in [0, {len(self.chunks)}) "
                             "that verify and replay do not")

    @property
    def decode_rows(self) -> frozenset[int]:
        """The chunks whose every row attends as a decode row of its own position."""
        return frozenset(self.verify) | frozenset(self.replay)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def num_logit_rows(self) -> int:
        if self.every_row:
            return self.num_tokens
        return sum(c.samples for c in self.chunks) + sum(len(self.chunks[i].token_ids) - 1 for i in self.verify)


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """``logits``: float32 ``[rows, vocab]``, one row per logit row of the input, in order.
    ``hidden``: float32 ``[rows, hidden]`` final-norm states of the same rows, when asked for.
    ``sums``: float32 ``[len(sum_chunks), hidden]``, when ``sum_chunks`` was given.
    ``states``: float32 ``[tokens, hidden]``, every row's state before the final norm (``states``)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    sums: torch.Tensor | None = None
    states: torch.Tensor | None = None  # float32 [tokens, hidden], every row's, when asked for
