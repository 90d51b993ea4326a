"""A step's model inputs as one int64 tensor: what rank 0 broadcasts to the other ranks.

The inputs are the runner's (a :class:`~engine_workers.model.execution.batch.ModelInput`): per
sequence its token ids to compute, how many were computed before, its block table and whether it
samples, and how its rows attend (``PLAIN``; ``VERIFY`` or ``REPLAY``: as decode rows of their own
positions, ``ModelInput.verify`` / ``ModelInput.replay``; ``PREFILL``: a one-token chunk as a
prefill row, ``ModelInput.prefill``), plus the step's ``every_row`` switch.
Every rank rebuilds the same attention metadata (positions, slot mapping, decode groups, masks)
from these, so only ids and tables travel, not the derived tensors. Layout: ``[every_row, n]``,
then ``n`` rows of ``(tokens, start, blocks, samples, mode)``, then every chunk's tokens, then
every chunk's block ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_workers.model.execution.batch import Chunk as BatchChunk
from engine_workers.model.execution.batch import ModelInput

Chunk = tuple[list[int], int, list[int], bool]  # engine_workers.model.execution.batch.Chunk, unpacked

PLAIN, VERIFY, REPLAY, PREFILL = 0, 1, 2, 3  # a chunk's mode (PREFILL: a one-token prompt chunk)


def encode(chunks: Sequence[Chunk], every_row: bool, modes: Sequence[int] = ()) -> torch.Tensor:
    """``modes``: per chunk, ``PLAIN``, ``VERIFY``, ``REPLAY`` or ``PREFILL`` (empty: all plain)."""
    modes = modes or [PLAIN] * len(chunks)
    if len(modes) != len(chunks):
        raise ValueError(f"{len(modes)} modes for {len(chunks)} chunks")
    head = [int(every_row), len(chunks)]
    tokens: list[int] = []
    blocks: list[int] = []
    for (toks, start, table, samples), mode in zip(chunks, modes):
        head += [len(toks), start, len(table), int(samples), mode]
        tokens += toks
        blocks += table
    return torch.tensor(head + tokens + blocks, dtype=torch.long)


def decode(flat: torch.Tensor) -> tuple[list[Chunk], bool, list[int]]:
    """``(chunks, every_row, modes)`` as given to :func:`encode` (modes spelled out)."""
    v = flat.tolist()
    every_row, n = bool(v[0]), v[1]
    rows = [v[2 + 5 * i : 7 + 5 * i] for i in range(n)]
    at = 2 + 5 * n
    chunks: list[Chunk] = []
    token_at, block_at = at, at + sum(r[0] for r in rows)
    for nt, start, nb, samples, _mode in rows:
        chunks.append((v[token_at : token_at + nt], start, v[block_at : block_at + nb], bool(samples)))
        token_at += nt
        block_at += nb
    return chunks, every_row, [r[4] for r in rows]


def modes_of(batch: ModelInput) -> list[int]:
    """Per chunk of ``batch``, its mode."""
    verify, replay, prefill = set(batch.verify), set(batch.replay), set(batch.prefill)
    return [VERIFY if i in verify else REPLAY if i in replay else PREFILL if i in prefill else PLAIN
            for i in range(len(batch.chunks))]


def model_input(chunks: Sequence[Chunk], every_row: bool, modes: Sequence[int]) -> ModelInput:
    """What a follower rank runs: the chunks with rank 0's modes (the same attention and logit rows)."""
    return ModelInput(tuple(BatchChunk(*c) for c in chunks), every_row,
                      verify=tuple(i for i, m in enumerate(modes) if m == VERIFY),
                      replay=tuple(i for i, m in enumerate(modes) if m == REPLAY),
                      prefill=tuple(i for i, m in enumerate(modes) if m == PREFILL))
