"""Paged attention over a flat, mixed prefill+decode batch.

The batch is one flat run of T tokens from many sequences. Each layer writes its new K/V into the
paged cache (``slot = block_id * block_size + offset``) and then attends in two groups, each one
batched SDPA call for all its sequences:

* decode rows (one query token each): queries are grouped per KV head, ``[B, Hkv, G, D]``, so GQA
  needs no K/V repeat and the G query heads of a KV head share one gathered K/V;
* prefill chunks (several query tokens): padded to the longest chunk, with a causal mask offset by
  what the sequence had computed before this step.

K/V are gathered from the cache by slot index, so a prefix cached by another sequence is read
exactly like the sequence's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot each new token's K/V goes to
    # decode group
    dec_rows: torch.Tensor | None  # [Bd] rows of the flat batch
    dec_slots: torch.Tensor | None  # [Bd, Ld] slots to gather (padded)
    dec_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] bool, True = attend
    # prefill group
    pf_rows: torch.Tensor | None  # [Bp, Lq] rows of the flat batch (padded with 0)
    pf_valid: torch.Tensor | None  # [Bp, Lq] bool
    pf_slots: torch.Tensor | None  # [Bp, Lk]
    pf_mask: torch.Tensor | None  # [Bp, 1, Lq, Lk] bool


def build_metadata(
    chunks: list[tuple[int, int, list[int]]], block_size: int, device: torch.device
) -> tuple[AttnMetadata, torch.Tensor]:
    """``chunks``: per sequence ``(num_computed_before, num_new, block_ids)`` in batch order.

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

    def ctx_slots(items: list, length: int) -> list[list[int]]:
        out = []
        for _, start, n, blocks in items:
            ctx = start + n
            s = [blocks[p // block_size] * block_size + p % block_size for p in range(ctx)]
            out.append(s + [0] * (length - ctx))
        return out

    dec_rows = dec_slots = dec_mask = None
    if dec:
        ld = max(start + n for _, start, n, _ in dec)
        dec_rows = torch.tensor([r for r, _, _, _ in dec], dtype=torch.long)
        dec_slots = torch.tensor(ctx_slots(dec, ld), dtype=torch.long)
        ctx = torch.tensor([start + n for _, start, n, _ in dec])
        dec_mask = (torch.arange(ld)[None, :] < ctx[:, None])[:, None, None, :]
    pf_rows = pf_valid = pf_slots = pf_mask = None
    if pf:
        lq = max(n for _, _, n, _ in pf)
        lk = max(start + n for _, start, n, _ in pf)
        rows = torch.zeros(len(pf), lq, dtype=torch.long)
        valid = torch.zeros(len(pf), lq, dtype=torch.bool)
        q_pos = torch.zeros(len(pf), lq, dtype=torch.long)
        ctx = torch.zeros(len(pf), 1, dtype=torch.long)
        for i, (r, start, n, _) in enumerate(pf):
            rows[i, :n] = torch.arange(r, r + n)
            valid[i, :n] = True
            q_pos[i, :n] = torch.arange(start, start + n)
            ctx[i] = start + n
        k_pos = torch.arange(lk)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx[:, :, None])
        mask[:, :, 0] |= ~valid  # padded query rows attend to one key: no NaN from an empty row
        pf_rows, pf_valid = rows, valid
        pf_slots = torch.tensor(ctx_slots(pf, lk), dtype=torch.long)
        pf_mask = mask[:, None]
    meta = AttnMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        dec_rows=dec_rows, dec_slots=dec_slots, dec_mask=dec_mask,
        pf_rows=pf_rows, pf_valid=pf_valid, pf_slots=pf_slots, pf_mask=pf_mask,
    )
    if device.type != "cpu":
        for name in AttnMetadata.__slots__:
            t = getattr(meta, name)
            if t is not None:
                setattr(meta, name, t.to(device, non_blocking=True))
    return meta, torch.tensor(positions, dtype=torch.long, device=device)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, attend, return ``[T, Hq * D]``."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.dec_rows is not None:
        bd, ld = meta.dec_slots.shape
        qd = q.index_select(0, meta.dec_rows).view(bd, hkv, group, d)
        idx = meta.dec_slots.view(-1)
        kd = k_cache.index_select(0, idx).view(bd, ld, hkv, d).transpose(1, 2)
        vd = v_cache.index_select(0, idx).view(bd, ld, hkv, d).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.dec_mask, scale=scale)
        out.index_copy_(0, meta.dec_rows, od.reshape(bd, hq, d))
    if meta.pf_rows is not None:
        bp, lq = meta.pf_rows.shape
        lk = meta.pf_slots.shape[1]
        qp = q[meta.pf_rows].transpose(1, 2)  # [Bp, Hq, Lq, D]
        idx = meta.pf_slots.view(-1)
        kp = k_cache.index_select(0, idx).view(bp, lk, hkv, d).transpose(1, 2)
        vp = v_cache.index_select(0, idx).view(bp, lk, hkv, d).transpose(1, 2)
        if group > 1:
            kp = kp.repeat_interleave(group, dim=1)
            vp = vp.repeat_interleave(group, dim=1)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.pf_mask, scale=scale)
        op = op.transpose(1, 2)  # [Bp, Lq, Hq, D]
        out[meta.pf_rows[meta.pf_valid]] = op[meta.pf_valid]
    return out.view(t, hq * d)
