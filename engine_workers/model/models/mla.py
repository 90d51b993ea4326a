"""Multi-head latent attention (DeepSeek-V3) over a paged cache that stores the compressed KV.

MLA projects each token to a latent ``c`` of ``kv_lora_rank`` dims (normed) plus one decoupled RoPE
key ``k_pe`` of ``qk_rope_head_dim`` dims shared by every head; per-head keys and values are
``kv_b_proj(c)``. The cache keeps exactly what the model compresses to: per layer, per token, ``c``
(the layer's "K" tensor, ``[slots, 1, kv_lora_rank]``) and the rotated ``k_pe`` (its "V" tensor,
``[slots, 1, qk_rope_head_dim]``), never the per-head K/V. The block pool is untouched: a block is
``block_size`` slots whatever a slot holds; only the per-layer tensors' trailing shape differs
(:attr:`MlaSpec.slot_shapes`, read by the runner). docs/design-history.md, "MLA cache layout", has the bytes.

Two ways to attend over that cache, one per kind of row:

* prefill chunks: *expanded*. The chunk's context latents go through ``kv_b_proj`` into per-head
  K (``[k_nope, k_pe]``) and V, then one SDPA, as transformers computes it. A prefill is
  compute-bound and its context is mostly its own tokens, so expanding costs what attending does.
* decode rows: *absorbed*. ``kv_b_proj``'s key half is folded into the query (``q_lat = q_nope @
  W_UK``, ``[H, kv_lora_rank]``) and its value half applied after the softmax (``o = (p @ c) @
  W_UV^T``), so the step reads only the cached latents, one multi-query attention with a
  ``kv_lora_rank + qk_rope_head_dim`` key, and never materialises per-head K/V for the context.
  The two forms are the same function; their roundings differ (float32: ~1e-6 of the logits).

RoPE: the rope dims rotate as interleaved pairs, which is DeepSeek's own layout when
``rope_interleave`` (the default); for a half-split checkpoint the loader reorders those rows
(:func:`map_mla_state`). The softmax scale folds YaRN's ``mscale_all_dim`` in twice, as DeepSeek
does (:func:`softmax_scale`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_workers.kernels.paged_reference import additive_mask, decode_mask, gather_blocks
from engine_workers.model.models.attention import AttnMetadata
from engine_workers.model.models.rope import apply_rope, interleave_rope_rows

# The config fields the MLA part of a DeepSeek-V3 spec reads.
MLA_READ = frozenset({"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim",
                      "v_head_dim", "rope_interleave", "attention_bias"})


@dataclass(frozen=True, slots=True)
class MlaSpec:
    num_heads: int
    q_lora_rank: int | None  # None: q straight from the hidden state (q_proj)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float  # the softmax's, YaRN's mscale folded in
    rope_interleave: bool = True  # the checkpoint's rope dims are interleaved pairs (else half-split)
    bias: bool = False  # attention_bias: on q_a_proj, kv_a_proj_with_mqa and o_proj

    @property
    def slot_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Per cache slot: the latent's shape and the RoPE key's (the runner's two per-layer tensors)."""
        return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)

    @property
    def latent_elems(self) -> int:
        """Elements one token stores per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expanded_elems(self) -> int:
        """Elements one token would store per layer as per-head K and V (what a standard cache
        would hold for the same attention): ``H * (qk_nope + qk_rope) + H * v_head_dim``."""
        return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def softmax_scale(cfg) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under a scaled RoPE
    that names ``mscale_all_dim`` (DeepSeek's reference; transformers' ``yarn_apply_mscale``)."""
    scale = float(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


def mla_spec(cfg) -> MlaSpec | None:
    """The MLA part of ``cfg`` (None for the families without it); ValueError naming the field."""
    if cfg.model_type != "deepseek_v3":
        return None
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if kv_heads != heads:  # kv_b_proj makes one K/V per query head: MLA has no grouped form
        raise ValueError(f"config field num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA")
    nope, rope, v = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    if rope <= 0 or rope % 2:
        raise ValueError(f"config field qk_rope_head_dim={rope} must be even and positive")
    qk = getattr(cfg, "qk_head_dim", None)
    if qk is not None and qk != nope + rope:
        raise ValueError(f"config field qk_head_dim={qk} is not qk_nope_head_dim + qk_rope_head_dim = {nope + rope}")
    q_rank = cfg.q_lora_rank
    for name, value in (("kv_lora_rank", cfg.kv_lora_rank), ("q_lora_rank", q_rank), ("v_head_dim", v)):
        if value is not None and int(value) <= 0:
            raise ValueError(f"config field {name}={value} must be positive")
    return MlaSpec(heads, None if q_rank is None else int(q_rank), int(cfg.kv_lora_rank), nope, rope, v,
                   softmax_scale(cfg), bool(getattr(cfg, "rope_interleave", True)),
                   bool(getattr(cfg, "attention_bias", False)))


class MlaAttention(nn.Module):
    """One MLA layer; ``forward`` has the dense attention's signature, its two cache tensors being
    the layer's latent and RoPE-key caches. ``norm(dim)`` builds the model's RMSNorm."""

    def __init__(self, spec: MlaSpec, hidden: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.spec = spec
        h, qk = spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank is None:
            self.q_proj: nn.Module | None = nn.Linear(hidden, h * qk, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, spec.q_lora_rank, bias=spec.bias)
            self.q_a_layernorm = norm(spec.q_lora_rank)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, spec.kv_lora_rank + spec.qk_rope_head_dim, bias=spec.bias)
        self.kv_a_layernorm = norm(spec.kv_lora_rank)
        # kv_b_proj's weight [H * (nope + v), kv_lora_rank] as a plain parameter, not a Linear: the
        # decode path splits it per head to absorb it, so the CPU linear kernels must not repack it
        self.kv_b = nn.Parameter(torch.empty(h * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank))
        self.o_proj = nn.Linear(h * spec.v_head_dim, hidden, bias=spec.bias)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, rot: torch.Tensor, c_cache: torch.Tensor, pe_cache: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        s = self.spec
        t, h, nope, r = x.shape[0], s.num_heads, s.qk_nope_head_dim, s.qk_rope_head_dim
        q = self._queries(x).view(t, h, nope + r)
        q_nope, q_pe = q[..., :nope], apply_rope(q[..., nope:], rot)
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[:, : s.kv_lora_rank]).view(t, 1, s.kv_lora_rank)
        k_pe = apply_rope(kv[:, s.kv_lora_rank :].view(t, 1, r), rot)
        # from here on, the latents are what the cache stores (its dtype): a chunk attends to its
        # own tokens as it will later read them back, so chunking and prefix hits change nothing
        c, k_pe = c.to(c_cache.dtype), k_pe.to(pe_cache.dtype)
        c_cache.index_copy_(0, meta.slot_mapping, c)
        pe_cache.index_copy_(0, meta.slot_mapping, k_pe)
        out = x.new_empty(t, h, s.v_head_dim)
        if meta.decode:
            self._decode(q_nope, q_pe, c_cache, pe_cache, meta, out)
        for chunk in meta.prefill:
            rows = slice(chunk.first, chunk.first + chunk.n)
            if chunk.blocks is None:  # starts its sequence: its own latents are its whole context
                ctx_c, ctx_pe, mask = c[rows, 0], k_pe[rows, 0], None
            else:
                ctx = chunk.start + chunk.n
                ctx_c = gather_blocks(c_cache, chunk.blocks, meta.block_size)[:ctx, 0]
                ctx_pe = gather_blocks(pe_cache, chunk.blocks, meta.block_size)[:ctx, 0]
                mask = chunk.mask
                if mask is None:  # metadata built for the dense prefill kernel carries none
                    causal = torch.arange(ctx)[None, :] <= torch.arange(chunk.start, ctx)[:, None]
                    mask = additive_mask(causal, x.dtype).to(x.device)
            out[rows] = self._expanded(q_nope[rows], q_pe[rows], ctx_c.to(x.dtype), ctx_pe.to(x.dtype), mask)
        return self.o_proj(out.view(t, h * s.v_head_dim))

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx_c: torch.Tensor, ctx_pe: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """One prefill chunk: ``q_*`` ``[n, H, *]``, the context's latents ``[m, kv_lora_rank]``
        and RoPE keys ``[m, rope]`` -> ``[n, H, v_head_dim]``; ``mask`` None = causal from 0."""
        s = self.spec
        m, h, nope = ctx_c.shape[0], s.num_heads, s.qk_nope_head_dim
        kv = F.linear(ctx_c, self.kv_b).view(m, h, nope + s.v_head_dim)
        k = torch.cat([kv[..., :nope], ctx_pe[:, None, :].expand(m, h, s.qk_rope_head_dim)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           kv[..., nope:].transpose(0, 1)[None], attn_mask=mask,
                                           is_causal=mask is None, scale=s.scale)
        return o[0].transpose(0, 1)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_cache: torch.Tensor, pe_cache: torch.Tensor,
                meta: AttnMetadata, out: torch.Tensor) -> None:
        """The decode rows, absorbed: per length group, ``[B, H, kv_lora_rank]`` latent queries
        against the gathered latents (one key head for all query heads)."""
        s = self.spec
        w = self.kv_b.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        w_uk, w_uv = w[:, : s.qk_nope_head_dim], w[:, s.qk_nope_head_dim :]  # [H, nope, R], [H, v, R]
        dtype = q_nope.dtype
        for g in meta.decode:
            q_lat = torch.einsum("bhd,hdr->bhr", q_nope.index_select(0, g.rows), w_uk)
            c = gather_blocks(c_cache, g.blocks, meta.block_size)[:, :, 0].to(dtype)  # [B, N, R]
            pe = gather_blocks(pe_cache, g.blocks, meta.block_size)[:, :, 0].to(dtype)  # [B, N, rope]
            scores = torch.baddbmm(torch.bmm(q_lat, c.transpose(1, 2)), q_pe.index_select(0, g.rows),
                                   pe.transpose(1, 2)) * s.scale  # [B, H, N]
            mask = g.mask if g.mask is not None else decode_mask(g.ctx.cpu(), c.shape[1], dtype).to(c.device)
            probs = torch.softmax((scores + mask.view(mask.shape[0], 1, -1)).float(), dim=-1).to(dtype)
            o_lat = torch.bmm(probs, c)  # [B, H, R]
            out.index_copy_(0, g.rows, torch.einsum("bhr,hvr->bhv", o_lat, w_uv))


def map_mla_state(take: Callable[[str], torch.Tensor], spec: MlaSpec, src: str, dst: str) -> dict[str, torch.Tensor]:
    """Layer ``src``'s (``model.layers.{i}.``) attention weights as ours (``dst`` + ``self_attn.``):
    a half-split checkpoint's RoPE rows (each head's last ``qk_rope_head_dim`` rows of the query,
    the last rows of ``kv_a_proj_with_mqa``) reordered to the interleaved pairs RoPE rotates."""
    attn, ours = src + "self_attn.", dst + "self_attn."
    h, nope, r = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim

    def q_rows(w: torch.Tensor) -> torch.Tensor:
        if spec.rope_interleave:
            return w
        per = w.reshape(h, nope + r, *w.shape[1:])
        rope = interleave_rope_rows(per[:, nope:].reshape(h * r, *w.shape[1:]), h, r).reshape(h, r, *w.shape[1:])
        return torch.cat([per[:, :nope], rope], dim=1).reshape(w.shape)

    def kv_rows(w: torch.Tensor) -> torch.Tensor:
        if spec.rope_interleave:
            return w
        return torch.cat([w[: spec.kv_lora_rank], interleave_rope_rows(w[spec.kv_lora_rank :], 1, r)])

    out: dict[str, torch.Tensor] = {}
    if spec.q_lora_rank is None:
        out[ours + "q_proj.weight"] = q_rows(take(attn + "q_proj.weight"))
    else:
        out[ours + "q_a_proj.weight"] = take(attn + "q_a_proj.weight")
        out[ours + "q_a_layernorm.weight"] = take(attn + "q_a_layernorm.weight")
        out[ours + "q_b_proj.weight"] = q_rows(take(attn + "q_b_proj.weight"))
    out[ours + "kv_a_proj_with_mqa.weight"] = kv_rows(take(attn + "kv_a_proj_with_mqa.weight"))
    out[ours + "kv_a_layernorm.weight"] = take(attn + "kv_a_layernorm.weight")
    out[ours + "kv_b"] = take(attn + "kv_b_proj.weight")
    out[ours + "o_proj.weight"] = take(attn + "o_proj.weight")
    if spec.bias:
        if spec.q_lora_rank is not None:
            out[ours + "q_a_proj.bias"] = take(attn + "q_a_proj.bias")
        out[ours + "kv_a_proj_with_mqa.bias"] = kv_rows(take(attn + "kv_a_proj_with_mqa.bias"))
        out[ours + "o_proj.bias"] = take(attn + "o_proj.bias")
    return out
