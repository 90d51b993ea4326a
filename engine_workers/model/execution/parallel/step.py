"""A step's model inputs as one int64 tensor: what rank 0 broadcasts to the other ranks.

The inputs are the runner's (a :class:`~engine_workers.model.execution.batch.ModelInput`): per
sequence its token ids to compute, how many were computed before, its block table and whether it
samples, plus the step's ``every_row`` switch. Every rank rebuilds the same attention metadata
(positions, slot mapping, decode groups, masks) from these, so only ids and tables travel, not the
derived tensors. Layout: ``[every_row, n]``, then ``n`` rows of ``(tokens, start, blocks, samples)``,
then every chunk's tokens, then every chunk's block ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Chunk = tuple[list[int], int, list[int], bool]  # engine_workers.model.execution.batch.Chunk, unpacked


def encode(chunks: Sequence[Chunk], every_row: bool) -> torch.Tensor:
    head = [int(every_row), len(chunks)]
    tokens: list[int] = []
    blocks: list[int] = []
    for toks, start, table, samples in chunks:
        head += [len(toks), start, len(table), int(samples)]
        tokens += toks
        blocks += table
    return torch.tensor(head + tokens + blocks, dtype=torch.long)


def decode(flat: torch.Tensor) -> tuple[list[Chunk], bool]:
    v = flat.tolist()
    every_row, n = bool(v[0]), v[1]
    rows = [v[2 + 4 * i : 6 + 4 * i] for i in range(n)]
    at = 2 + 4 * n
    chunks: list[Chunk] = []
    token_at, block_at = at, at + sum(r[0] for r in rows)
    for nt, start, nb, samples in rows:
        chunks.append((v[token_at : token_at + nt], start, v[block_at : block_at + nb], bool(samples)))
        token_at += nt
        block_at += nb
    return chunks, every_row
