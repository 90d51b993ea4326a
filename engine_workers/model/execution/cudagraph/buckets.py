"""Which decode steps run as a captured CUDA graph, and their inputs padded to the graph's shape:
pure arithmetic over the step's chunks (no torch, no device), so it is tested on any machine.

A CUDA graph replays fixed shapes, and a serving step's shape changes every step. As vLLM does,
the batch is padded up to the smallest *batch bucket* that holds it: ``1, 2, 4, 8`` then every
``8`` up to ``max_num_seqs`` (:func:`batch_buckets`). Unlike vLLM, whose paged-attention kernel
reads the block tables itself, this engine's decode attention gathers K/V for a table padded to the
batch's widest sequence, so that width is a shape too: it is padded up to a *width bucket*, a
power of two of blocks (:func:`width_buckets`). A graph is keyed by ``(batch bucket, width
bucket)``; a bucket grid of ``B`` batch and ``W`` width sizes bounds the graphs at ``B * W``.

Padding must change nothing that matters:

* a padded *row* (a sequence slot past the real batch) decodes token 0 at position 0 with a
  context of one token in the **dummy block**, a block the runner allocates past the KV manager's
  pool: its K/V write lands there, it attends only to that slot, and its logits are dropped;
* a padded *column* of a real row's block table points at block 0 and is masked out (its context
  length ends before it), exactly as the eager path already pads a decode group.

Steps that run eager (:func:`plan`): anything with a prefill chunk (prefill and mixed steps: their
shapes are prompt lengths), steps that want every row's logits, hidden states or pooled sums,
batches above the largest batch bucket and contexts wider than the largest width bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Chunk = tuple[list[int], int, list[int], bool]  # (token ids, computed before, block ids, samples): the runner's


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: ``1, 2, 4``, then multiples of 8, the last being
    ``max_num_seqs`` itself (so a full batch is never padded past the scheduler's limit)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return (*sizes, max_num_seqs)


def width_buckets(max_blocks: int) -> tuple[int, ...]:
    """Block-table widths graphs are captured for: powers of two below ``max_blocks`` (the most
    blocks one sequence can hold), then ``max_blocks``."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    sizes, w = [], 1
    while w < max_blocks:
        sizes.append(w)
        w *= 2
    return (*sizes, max_blocks)


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n``; None above the largest."""
    for s in sizes:
        if s >= n:
            return s
    return None


@dataclass(frozen=True, slots=True)
class Plan:
    """A step's verdict: replay graph ``key`` ``(batch, width)``, or run eager (``key`` None) for
    ``reason``."""

    key: tuple[int, int] | None
    reason: str = ""


def plan(chunks: Sequence[Chunk], block_size: int, batches: tuple[int, ...], widths: tuple[int, ...],
         every_row: bool = False, wants_hidden: bool = False, pools: bool = False) -> Plan:
    if every_row or wants_hidden or pools:
        return Plan(None, "every row's logits, hidden states or pooled sums asked")
    if not chunks:
        return Plan(None, "empty step")
    width = 0
    for tokens, start, blocks, samples in chunks:
        if len(tokens) != 1 or not samples:
            return Plan(None, "prefill or mixed step")
        need = -(-(start + 1) // block_size)
        if len(blocks) < need:
            raise ValueError(f"a decode at position {start} needs {need} blocks, its table has {len(blocks)}")
        width = max(width, need)
    b = bucket(len(chunks), batches)
    if b is None:
        return Plan(None, f"batch of {len(chunks)} above the largest graph bucket {batches[-1]}")
    w = bucket(width, widths)
    if w is None:
        return Plan(None, f"context of {width} blocks above the largest graph width {widths[-1]}")
    return Plan((b, w))


@dataclass(frozen=True, slots=True)
class Padded:
    """A decode step's inputs at graph shape ``(batch, width)``: flat per row, ``tables`` row-major
    ``batch * width``. Rows ``[real:]`` are padding (module docstring)."""

    real: int
    batch: int
    width: int
    ids: tuple[int, ...]
    positions: tuple[int, ...]
    slots: tuple[int, ...]
    tables: tuple[int, ...]
    ctx: tuple[int, ...]


def pad(chunks: Sequence[Chunk], key: tuple[int, int], block_size: int, dummy_block: int) -> Padded:
    """``chunks`` (a decode-only step :func:`plan` gave ``key``) padded to that graph's shape."""
    batch, width = key
    if len(chunks) > batch:
        raise ValueError(f"{len(chunks)} sequences do not fit a graph of batch {batch}")
    ids, positions, slots, tables, ctx = [], [], [], [], []
    for tokens, start, blocks, _ in chunks:
        need = -(-(start + 1) // block_size)
        if need > width:
            raise ValueError(f"a context of {need} blocks does not fit a graph of width {width}")
        ids.append(tokens[0])
        positions.append(start)
        slots.append(blocks[start // block_size] * block_size + start % block_size)
        tables.extend(blocks[:need])
        tables.extend([0] * (width - need))  # block 0, masked: past this row's context
        ctx.append(start + 1)
    for _ in range(batch - len(chunks)):
        ids.append(0)
        positions.append(0)
        slots.append(dummy_block * block_size)
        tables.extend([dummy_block] * width)  # nothing but the dummy block, attended at slot 0 only
        ctx.append(1)
    return Padded(len(chunks), batch, width, tuple(ids), tuple(positions), tuple(slots), tuple(tables), tuple(ctx))
