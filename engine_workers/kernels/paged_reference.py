"""Paged decode attention in plain torch (gather + SDPA): the engine's path where its CPU kernel
is off or missing, and the reference the kernel is checked against when it loads.

The cache may hold K/V in a narrower dtype than the queries (``--kv-cache-dtype``): the gathered
copy is widened to the queries' dtype, so the attention math is the compute dtype's either way."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean attend-mask -> the additive form SDPA adds to its scores. Built once per step:
    given a boolean mask, SDPA would convert it in every layer."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


def decode_mask(ctx: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Context lengths ``[B]`` -> the additive mask ``[B, 1, 1, width]`` of padded decode K/V."""
    return additive_mask((torch.arange(width)[None, :] < ctx[:, None])[:, None, None, :], dtype)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block tables ``[..., N]`` -> ``[..., N * block_size, Hkv, D]`` (a copy, one row per block)."""
    hkv, d = cache.shape[1], cache.shape[2]
    by_block = cache.view(-1, block_size * hkv * d)
    return by_block.index_select(0, blocks.reshape(-1)).view(*blocks.shape[:-1], -1, hkv, d)


def sdpa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                mask: torch.Tensor | None, block_size: int, scale: float) -> torch.Tensor:
    """Decode attention through gather + SDPA: ``q`` ``[B, Hq, D]``, block tables ``[B, N]``,
    additive ``mask`` ``[B, 1, 1, N * block_size]``; returns ``[B, Hq, D]``. Queries are grouped per
    KV head (``[B, Hkv, G, D]``), so GQA needs no K/V repeat."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    kd = gather_blocks(k_cache, tables, block_size).to(q.dtype).transpose(1, 2)
    vd = gather_blocks(v_cache, tables, block_size).to(q.dtype).transpose(1, 2)
    od = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), kd, vd, attn_mask=mask, scale=scale)
    return od.reshape(b, hq, d)
