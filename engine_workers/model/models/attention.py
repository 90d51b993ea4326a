"""Paged attention over a flat, mixed prefill+decode batch.

The batch is one flat run of T tokens from many sequences. Each layer writes its new K/V into the
paged cache (``slot = block_id * block_size + offset``) and then attends:

* decode rows (one query token each) in a few *groups* of sequences with similar context lengths,
  one batched SDPA call per group. K/V are gathered from the cache a whole block at a time (one
  ``block_size * Hkv * D`` row per block-table entry) and padded to the group's longest table, so
  grouping by length bounds the padding a long sequence would force on short ones (the gather is
  memory-bound: padded blocks cost as much as real ones). Queries are grouped per KV head,
  ``[B, Hkv, G, D]``, so GQA needs no K/V repeat.
* prefill chunks one SDPA call each, unpadded. A chunk that starts a sequence (nothing computed
  before it) attends only to its own new K/V: no gather, no mask, ``is_causal``. A chunk that
  continues one (chunked prefill, a prefix-cache hit, a resumed preemption) gathers its blocks and
  uses a causal mask offset by what was computed before.

The cache may store K/V in a narrower dtype than the compute dtype (``--kv-cache-dtype bfloat16``
on a CPU): the write converts, the readers widen (the CPU kernels element by element, the SDPA
path after its gather), and the math stays in the compute dtype. A chunk that starts its sequence
attends over its own K/V *as stored* (rounded to the cache dtype), not the unrounded values, so a
sequence's output does not depend on how it was chunked or whether its prefix came from the cache.

Padding a whole mixed batch into one call instead wastes work in proportion to the spread of
lengths, and serving prompts vary widely in length, so per-chunk prefill calls and length groups
do the work one padded call would spend on padding (docs/design-history.md, Paged attention; figures in
docs/benchmarks.md, Engine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine_workers.kernels.paged_reference import additive_mask, decode_mask, gather_blocks, sdpa_decode

# Cost of one extra decode group, in gathered blocks: the calls a group adds (two gathers, one
# SDPA, one scatter per layer) take about as long as gathering and attending over this many
# padded blocks. Measured on CPU; the split is not sensitive to it within 2x.
GROUP_COST_BLOCKS = 24
MAX_DECODE_GROUPS = 4


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    rows: torch.Tensor  # [B] long: rows of the flat batch
    blocks: torch.Tensor  # [B, N] long: block tables padded with block 0
    mask: torch.Tensor | None  # [B, 1, 1, N * block_size] additive: 0 = attend, -inf = padding (SDPA)
    ctx: torch.Tensor  # [B] long: context lengths (the decode kernel; sliding-window masks)


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    first: int  # first row of the chunk in the flat batch
    n: int  # its tokens
    # Continuation chunks only (something computed before): the sequence's block table [N] and the
    # additive causal mask [n, start + n] (None with the prefill kernel, which needs none). Both
    # None for a chunk that starts its sequence.
    blocks: torch.Tensor | None
    mask: torch.Tensor | None
    start: int = 0  # tokens of the sequence computed before this chunk (its context is start + n)


@dataclass(frozen=True, slots=True)
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot each new token's K/V goes to
    block_size: int
    decode: tuple[DecodeGroup, ...]
    prefill: tuple[PrefillChunk, ...]
    # (q, k_cache, v_cache, tables, ctx, block_size, scale) -> out: the CPU paged decode kernel
    # (engine_workers.kernels.cpu_kernels); None = gather + SDPA
    decode_kernel: Callable | None = None
    # (q [n, Hq, D], k [ctx, Hkv, D], v, scale) -> out [n, Hq, D]: the CPU causal prefill kernel;
    # None = SDPA
    prefill_kernel: Callable | None = None
    max_context: int = 0  # the longest context (computed before + new) of any sequence in the batch
    # [T] long: per token, its sequence's context at this step (computed before + new); built only
    # when asked (longrope and dynamic RoPE choose a sequence's rotation by it)
    seq_ends: torch.Tensor | None = None
    # sliding-window masks built on first use, one entry per window size, shared by the layers
    # with that window in this step (see window_masks)
    windowed: dict[int, WindowMasks] = field(default_factory=dict, compare=False)


@dataclass(frozen=True, slots=True)
class WindowMasks:
    """Additive masks for one sliding window over one step's batch: per decode group
    ``[B, 1, 1, N * block_size]`` and per prefill chunk ``[n, context]``. A query at position ``p``
    attends to keys ``j`` with ``p - window < j <= p`` (transformers' sliding_window_overlay: the
    window counts the query's own token)."""

    decode: tuple[torch.Tensor, ...]
    prefill: tuple[torch.Tensor, ...]


def split_by_length(nblocks: list[int], group_cost: int = GROUP_COST_BLOCKS,
                    max_groups: int = MAX_DECODE_GROUPS) -> list[list[int]]:
    """Partition sequence indices into at most ``max_groups`` groups of similar block counts,
    minimising gathered blocks (each group padded to its longest) + ``group_cost`` per group.

    Exact dynamic programming over the indices sorted by length; cut points are restricted to a
    grid of at most 32 positions so a step of hundreds of sequences stays cheap in Python."""
    order = sorted(range(len(nblocks)), key=nblocks.__getitem__)
    lens = [nblocks[i] for i in order]
    n = len(lens)
    step = max(1, -(-n // 32))
    cuts = sorted(set(range(0, n, step)) | {n})
    # best[g][c]: min cost covering lens[:cuts[c]] with g groups; back-pointers in prev
    inf = float("inf")
    best = [[inf] * len(cuts) for _ in range(max_groups + 1)]
    prev = [[0] * len(cuts) for _ in range(max_groups + 1)]
    best[0][0] = 0
    for g in range(1, max_groups + 1):
        for c in range(1, len(cuts)):
            hi = cuts[c]
            for b in range(c):
                if best[g - 1][b] == inf:
                    continue
                cost = best[g - 1][b] + (hi - cuts[b]) * lens[hi - 1] + group_cost
                if cost < best[g][c]:
                    best[g][c], prev[g][c] = cost, b
    last = len(cuts) - 1
    g = min(range(1, max_groups + 1), key=lambda k: best[k][last])
    groups: list[list[int]] = []
    c = last
    while g > 0:
        b = prev[g][c]
        groups.append(order[cuts[b] : cuts[c]])
        c, g = b, g - 1
    return groups[::-1]


def build_metadata(
    chunks: list[tuple[int, int, list[int]]], block_size: int, device: torch.device,
    dtype: torch.dtype = torch.float32, decode_kernel: Callable | None = None,
    prefill_kernel: Callable | None = None, max_decode_groups: int = MAX_DECODE_GROUPS, seq_ends: bool = False,
    decode_rows: frozenset[int] | set[int] = frozenset(), prefill_chunks: frozenset[int] | set[int] = frozenset(),
) -> tuple[AttnMetadata, torch.Tensor]:
    """``chunks``: per sequence ``(num_computed_before, num_new, block_ids)`` in batch order;
    ``dtype``: the model's (for the masks); ``decode_kernel``: attend decode rows with it (one
    group, no mask: the kernel reads each sequence's own length) instead of gather + SDPA;
    ``prefill_kernel``: attend prefill chunks with it (no masks: it is causal by construction);
    ``max_decode_groups``: at most this many gather + SDPA decode groups (see split_by_length);
    ``seq_ends``: fill ``AttnMetadata.seq_ends``; ``decode_rows``: indices of chunks whose every
    row attends as a decode row of its own position (speculative verification: each row sees the
    keys up to itself, as the single-token decode of that position would, and the K/V of the whole
    chunk are in the cache before any layer attends); ``prefill_chunks``: indices of one-token
    chunks attended as prefill rows (a prompt's last position computed on its own: the prefill
    path sums as it does for that row in a longer chunk, the decode path does not), where any
    other one-token chunk is a decode row.

    Returns the metadata and the positions tensor ``[T]``.
    """

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t if device.type == "cpu" else t.to(device, non_blocking=True)

    positions: list[int] = []
    slots: list[int] = []
    dec: list[tuple[int, int, list[int]]] = []  # (row, context length, blocks)
    prefill: list[PrefillChunk] = []
    row = 0
    for i, (start, n, blocks) in enumerate(chunks):
        pos = range(start, start + n)
        positions.extend(pos)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
        if (n == 1 and i not in prefill_chunks) or i in decode_rows:
            dec.extend((row + j, start + j + 1, blocks) for j in range(n))
        elif start == 0:
            prefill.append(PrefillChunk(row, n, None, None))
        else:
            ctx = start + n
            table = torch.tensor(blocks[: -(-ctx // block_size)], dtype=torch.long)
            mask = None  # the prefill kernel is causal by construction
            if prefill_kernel is None:
                causal = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
                mask = dev(additive_mask(causal, dtype))
            prefill.append(PrefillChunk(row, n, dev(table), mask, start))
        row += n

    groups: list[DecodeGroup] = []
    if dec:
        nblk = [-(-ctx // block_size) for _, ctx, _ in dec]
        for members in ([list(range(len(dec)))] if decode_kernel or max_decode_groups == 1
                        else split_by_length(nblk, max_groups=max_decode_groups)):
            width = max(nblk[i] for i in members)
            table = torch.tensor([dec[i][2][: nblk[i]] + [0] * (width - nblk[i]) for i in members], dtype=torch.long)
            ctx_lens = torch.tensor([dec[i][1] for i in members])
            rows = torch.tensor([dec[i][0] for i in members], dtype=torch.long)
            if decode_kernel:
                groups.append(DecodeGroup(rows, table, None, ctx_lens))
            else:
                groups.append(DecodeGroup(dev(rows), dev(table), dev(decode_mask(ctx_lens, width * block_size, dtype)),
                                          dev(ctx_lens)))
    max_context = max((start + n for start, n, _ in chunks), default=0)
    ends = None
    if seq_ends:  # a decode row's context ends at itself
        ends = dev(torch.tensor([e for i, (start, n, _) in enumerate(chunks)
                                 for e in (range(start + 1, start + n + 1) if i in decode_rows else [start + n] * n)],
                                dtype=torch.long))
    meta = AttnMetadata(dev(torch.tensor(slots, dtype=torch.long)), block_size, tuple(groups), tuple(prefill),
                        decode_kernel, prefill_kernel, max_context, ends)
    return meta, dev(torch.tensor(positions, dtype=torch.long))


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D] (any row stride)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks * block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache (converted to its dtype), attend, return ``[T, Hq * D]``
    in q's dtype. ``window``: a sliding-window layer's window (keys more than ``window - 1``
    positions before the query are not attended); ``None`` = full attention. ``softcap``: scores
    become ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2), on the masked path.
    ``sinks`` [Hq]: each head's sink logit joins its softmax's denominator (gpt-oss), masked path."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    bs = meta.block_size
    if k_cache.dtype != k.dtype:  # a cache of another dtype: from here on, K/V are what it stores
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if softcap is not None or sinks is not None:  # SDPA and the kernels cannot: the masked path, causal as a window
        return _windowed_attention(q, k, v, k_cache, v_cache, meta, scale, window or meta.max_context + 1, softcap,
                                   sinks)
    if window is not None and window < meta.max_context:
        return _windowed_attention(q, k, v, k_cache, v_cache, meta, scale, window)
    out = q.new_empty(t, hq, d)
    for g in meta.decode:
        qd = q.index_select(0, g.rows)
        if meta.decode_kernel is not None:
            od = meta.decode_kernel(qd, k_cache, v_cache, g.blocks, g.ctx, bs, scale)
        else:
            od = sdpa_decode(qd, k_cache, v_cache, g.blocks, g.mask, bs, scale)
        out.index_copy_(0, g.rows, od)
    for c in meta.prefill:
        rows = slice(c.first, c.first + c.n)
        if c.blocks is None:  # starts its sequence: its own K/V are all there is
            kp, vp = k[rows], v[rows]
        else:
            ctx = c.start + c.n
            kp, vp = gather_blocks(k_cache, c.blocks, bs)[:ctx], gather_blocks(v_cache, c.blocks, bs)[:ctx]
        if meta.prefill_kernel is not None:
            out[rows] = meta.prefill_kernel(q[rows], kp, vp, scale)
            continue
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        kp, vp = kp.to(q.dtype), vp.to(q.dtype)  # SDPA wants one dtype (no copy when they match)
        op = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=c.mask, is_causal=c.mask is None, scale=scale, enable_gqa=group > 1,
        )
        out[rows] = op[0].transpose(0, 1)
    return out.view(t, hq * d)


def window_masks(meta: AttnMetadata, window: int, dtype: torch.dtype) -> WindowMasks:
    """The step's masks for ``window`` (built once per step and window, then reused by every layer
    with that window)."""
    got = meta.windowed.get(window)
    if got is not None:
        return got
    dec = []
    for g in meta.decode:
        width = g.blocks.shape[1] * meta.block_size
        ctx = g.ctx.to(g.blocks.device)[:, None]
        j = torch.arange(width, device=g.blocks.device)[None, :]
        dec.append(additive_mask(((j < ctx) & (j > ctx - 1 - window))[:, None, None, :], dtype).to(g.blocks.device))
    pre = []
    for c in meta.prefill:
        pos = torch.arange(c.start, c.start + c.n)[:, None]
        j = torch.arange(c.start + c.n)[None, :]
        mask = additive_mask((j <= pos) & (j > pos - window), dtype)
        pre.append(mask if c.blocks is None else mask.to(c.blocks.device))
    got = WindowMasks(tuple(dec), tuple(pre))
    meta.windowed[window] = got
    return got


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` ``[B, Hq, n, D]``, ``k``/``v`` ``[B, Hkv, m, D]``, additive ``mask`` broadcasting to
    ``[B, Hq, n, m]``: SDPA, or with ``softcap`` the same math written out with the cap applied to
    the scores (transformers' eager Gemma 2 attention does it in this order: scale, cap, mask)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv * n, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(b, hkv, hq // hkv, n, -1) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + (mask[None, None, None] if mask.dim() == 2 else mask[:, :, None])
    if sinks is not None:  # one more logit per head in the softmax, dropped after it (it has no value)
        sink = sinks.to(scores.dtype).view(1, hkv, hq // hkv, 1, 1).expand(b, -1, -1, n, 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1)[..., :-1].to(q.dtype).reshape(b, hkv, hq // hkv * n, -1)
        return torch.matmul(probs, v).view(b, hq, n, d)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(b, hkv, hq // hkv * n, -1)
    return torch.matmul(probs, v).view(b, hq, n, d)


def _windowed_attention(q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A sliding-window layer in a step where some context is longer than the window: gather +
    SDPA under window masks (the engine's CPU kernels attend to the whole context). Every block
    stays in the cache (docs/design-history.md, Sliding-window attention), so this reads the same tables
    as full attention and masks what lies outside the window."""
    t, hq, d = q.shape
    bs = meta.block_size
    masks = window_masks(meta, window, q.dtype)
    out = q.new_empty(t, hq, d)
    for g, mask in zip(meta.decode, masks.decode):
        qd = q.index_select(0, g.rows)  # [B, Hq, D]: one query per sequence
        kd = gather_blocks(k_cache, g.blocks, bs).to(q.dtype).transpose(1, 2)
        vd = gather_blocks(v_cache, g.blocks, bs).to(q.dtype).transpose(1, 2)
        od = _attend(qd.unsqueeze(2), kd, vd, mask.to(q.device), scale, softcap, sinks)
        out.index_copy_(0, g.rows, od.squeeze(2))
    for c, mask in zip(meta.prefill, masks.prefill):
        rows = slice(c.first, c.first + c.n)
        if c.blocks is None:
            kp, vp = k[rows], v[rows]
        else:
            ctx = c.start + c.n
            kp, vp = gather_blocks(k_cache, c.blocks, bs)[:ctx], gather_blocks(v_cache, c.blocks, bs)[:ctx]
        op = _attend(q[rows].transpose(0, 1).unsqueeze(0), kp.to(q.dtype).transpose(0, 1).unsqueeze(0),
                     vp.to(q.dtype).transpose(0, 1).unsqueeze(0), mask.to(q.device), scale, softcap, sinks)
        out[rows] = op[0].transpose(0, 1)
    return out.view(t, hq * d)
