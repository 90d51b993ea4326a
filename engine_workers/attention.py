"""Paged attention over a flat, mixed prefill+decode batch.

The batch is one flat run of T tokens from many sequences. Each layer writes its new K/V into the
paged cache (``slot = block_id * block_size + offset``) and then attends in two groups, each one
batched SDPA call for all its sequences:

* decode rows (one query token each): queries are grouped per KV head, ``[B, Hkv, G, D]``, so GQA
  needs no K/V repeat and the G query heads of a KV head share one gathered K/V;
* prefill chunks (several query tokens): padded to the longest chunk, with a causal mask offset by
  what the sequence had computed before this step.

K/V are gathered from the cache a whole block at a time (one ``block_size * Hkv * D`` row per
block table entry), so a prefix cached by another sequence is read exactly like the sequence's own
tokens. Gathering per block instead of per token slot copies rows 16x longer and needs block
tables instead of per-token slot lists, so building the metadata costs less Python (0.8 -> 0.3 ms
per decode step at batch 16); the attention itself measured the same for decode and ~15 % faster
for prefill, where queries are grouped per KV head instead of repeating K/V. Table entries past a
sequence's last block are padded with block 0 and masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot each new token's K/V goes to
    block_size: int
    # decode group
    dec_rows: torch.Tensor | None  # [Bd] rows of the flat batch
    dec_blocks: torch.Tensor | None  # [Bd, Nd] block tables (padded with 0)
    dec_mask: torch.Tensor | None  # [Bd, 1, 1, Nd * block_size] additive: 0 = attend, -inf = not
    # prefill group
    pf_rows: torch.Tensor | None  # [Bp, Lq] rows of the flat batch (padded with 0)
    pf_valid: torch.Tensor | None  # [Bp, Lq] bool
    pf_blocks: torch.Tensor | None  # [Bp, Np] block tables (padded with 0)
    pf_mask: torch.Tensor | None  # [Bp, 1, G * Lq, Np * block_size] additive (query rows grouped per KV head)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean attend-mask -> the additive form SDPA adds to its scores. Built once per step:
    given a boolean mask, SDPA would convert it in every layer (~0.6 ms per prefill call on CPU)."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


def build_metadata(
    chunks: list[tuple[int, int, list[int]]], block_size: int, device: torch.device, group: int = 1,
    dtype: torch.dtype = torch.float32,
) -> tuple[AttnMetadata, torch.Tensor]:
    """``chunks``: per sequence ``(num_computed_before, num_new, block_ids)`` in batch order;
    ``group``: query heads per KV head; ``dtype``: the model's (for the masks).

    Returns the metadata and the positions tensor ``[T]``.
    """
    positions: list[int] = []
    slots: list[int] = []
    dec, pf = [], []
    row = 0
    for start, n, blocks in chunks:
        pos = range(start, start + n)
        positions.extend(pos)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
        (dec if n == 1 else pf).append((row, start, n, blocks))
        row += n

    def tables(items: list) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Block tables padded to the longest, the context lengths, and that width in blocks."""
        nblk = [-(-(start + n) // block_size) for _, start, n, _ in items]
        width = max(nblk)
        rows = [blocks[:k] + [0] * (width - k) for (_, _, _, blocks), k in zip(items, nblk)]
        ctx = torch.tensor([start + n for _, start, n, _ in items])
        return torch.tensor(rows, dtype=torch.long), ctx, width

    dec_rows = dec_blocks = dec_mask = None
    if dec:
        dec_rows = torch.tensor([r for r, _, _, _ in dec], dtype=torch.long)
        dec_blocks, ctx, width = tables(dec)
        dec_mask = _additive((torch.arange(width * block_size)[None, :] < ctx[:, None])[:, None, None, :], dtype)
    pf_rows = pf_valid = pf_blocks = pf_mask = None
    if pf:
        lq = max(n for _, _, n, _ in pf)
        rows = torch.zeros(len(pf), lq, dtype=torch.long)
        valid = torch.zeros(len(pf), lq, dtype=torch.bool)
        q_pos = torch.zeros(len(pf), lq, dtype=torch.long)
        for i, (r, start, n, _) in enumerate(pf):
            rows[i, :n] = torch.arange(r, r + n)
            valid[i, :n] = True
            q_pos[i, :n] = torch.arange(start, start + n)
        pf_blocks, ctx, width = tables(pf)
        k_pos = torch.arange(width * block_size)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx[:, None, None])
        mask[:, :, 0] |= ~valid  # padded query rows attend to one key: no NaN from an empty row
        pf_rows, pf_valid = rows, valid
        # The G query heads of one KV head attend as G * Lq rows against that head's K/V (no repeat).
        pf_mask = _additive(mask.repeat(1, group, 1)[:, None], dtype)
    meta = AttnMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long), block_size=block_size,
        dec_rows=dec_rows, dec_blocks=dec_blocks, dec_mask=dec_mask,
        pf_rows=pf_rows, pf_valid=pf_valid, pf_blocks=pf_blocks, pf_mask=pf_mask,
    )
    if device.type != "cpu":
        for name in AttnMetadata.__slots__:
            t = getattr(meta, name)
            if isinstance(t, torch.Tensor):
                setattr(meta, name, t.to(device, non_blocking=True))
    return meta, torch.tensor(positions, dtype=torch.long, device=device)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, N]`` block tables -> ``[B, Hkv, N * block_size, D]`` (a copy, one row per block)."""
    hkv, d = cache.shape[1], cache.shape[2]
    b, n = blocks.shape
    by_block = cache.view(-1, block_size * hkv * d)
    return by_block.index_select(0, blocks.view(-1)).view(b, n * block_size, hkv, d).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks * block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, attend, return ``[T, Hq * D]``."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    bs = meta.block_size
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.dec_rows is not None:
        bd = meta.dec_blocks.shape[0]
        qd = q.index_select(0, meta.dec_rows).view(bd, hkv, group, d)
        kd = _gather(k_cache, meta.dec_blocks, bs)
        vd = _gather(v_cache, meta.dec_blocks, bs)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.dec_mask, scale=scale)
        out.index_copy_(0, meta.dec_rows, od.reshape(bd, hq, d))
    if meta.pf_rows is not None:
        bp, lq = meta.pf_rows.shape
        # [Bp, Lq, Hkv, G, D] -> [Bp, Hkv, G * Lq, D]: query rows grouped per KV head
        qp = q[meta.pf_rows].view(bp, lq, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(bp, hkv, group * lq, d)
        kp = _gather(k_cache, meta.pf_blocks, bs)
        vp = _gather(v_cache, meta.pf_blocks, bs)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.pf_mask, scale=scale)
        op = op.view(bp, hkv, group, lq, d).permute(0, 3, 1, 2, 4).reshape(bp, lq, hq, d)
        out[meta.pf_rows[meta.pf_valid]] = op[meta.pf_valid]
    return out.view(t, hq * d)
