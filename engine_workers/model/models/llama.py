"""The decoder every family runs on (Llama, Mistral, Qwen2/3, Gemma 2/3, OLMo 2, Phi-3, and with sparse MLPs
Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3), over a flat token batch and a paged KV cache. A family's differences are the optional parts its
:class:`~engine_workers.model.models.spec.ModelSpec` switches on (sliding windows, soft-capping, post-norms,
QK-norm, GELU gating, embedding scaling); checkpoints' names map onto these modules in the loader.

Our own small modules rather than transformers' modeling code: the whole mixed prefill+decode
batch is one flat ``[T, hidden]`` tensor, Q/K/V and gate/up projections are fused into one GEMM
each, and the LM head runs only on the rows that sample. See docs/design-history.md for the trade-offs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine_workers.model.models.attention import AttnMetadata, paged_attention
from engine_workers.model.models.mla import MlaAttention
from engine_workers.model.models.moe import SparseMoeBlock
from engine_workers.model.models.rope import Rope, apply_rope, build_rope, interleave_rope_rows, inv_freq, table
from engine_workers.model.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderLayer", "LlamaForPagedLM", "ModelSpec", "RMSNorm", "apply_rope",
           "interleave_rope_rows", "rope_tables"]

if TYPE_CHECKING:
    from engine_workers.kernels.cpu_kernels import FusedOps

def rope_tables(cfg, spec: ModelSpec, max_len: int, device: torch.device) -> torch.Tensor:
    """The fixed rotation table ``[max_len, head_dim // 2]`` complex64 of ``cfg``'s RoPE (what
    :func:`engine_workers.model.models.rope.build_rope` gives as ``Rope.base``)."""
    freq, scaling = inv_freq(cfg, spec.head_dim)
    return table(freq, scaling, max_len).to(device)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # (residual, delta, weight, eps) -> out: the fused CPU kernel (LlamaForPagedLM.use_fused)
        self.fused: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """``residual += delta`` in place (the layer stack's residual stream), then the norm of it."""
        if self.fused is not None:
            return self.fused(residual, delta, self.weight, self.eps)
        if delta is not None:
            residual.add_(delta)
        return self(residual)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # sliding window of this layer, None = full attention
        self.softcap = spec.attn_softcap
        self.hq, self.hkv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = self.hq * self.d, self.hkv * self.d
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        self.q_norm = RMSNorm(self.d, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.d, spec.rms_norm_eps) if spec.qk_norm else None
        # OLMo 2: one RMSNorm over each whole projection (all heads), before RoPE
        self.q_norm_full = RMSNorm(self.q_size, spec.rms_norm_eps) if spec.qk_norm_full else None
        self.k_norm_full = RMSNorm(self.kv_size, spec.rms_norm_eps) if spec.qk_norm_full else None
        self.scale = spec.attn_scale if spec.attn_scale is not None else self.d**-0.5
        # gpt-oss: a learned logit per query head that joins every softmax (and takes no value)
        self.sinks = nn.Parameter(torch.empty(self.hq)) if spec.attn_sinks else None

    def forward(self, x, rot, k_cache, v_cache, meta: AttnMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.hkv, self.d)
        if self.q_norm_full is not None and self.k_norm_full is not None:
            q = apply_rope(self.q_norm_full(qkv[:, : self.q_size]).view(t, self.hq, self.d), rot)
            k = apply_rope(self.k_norm_full(qkv[:, self.q_size : self.q_size + self.kv_size]).view(t, self.hkv, self.d), rot)
        elif self.q_norm is None or self.k_norm is None:  # both or neither (spec.qk_norm)
            # q and k rotate together: one op over [T, Hq + Hkv, D] (weights are interleaved at load)
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, self.hq + self.hkv, self.d), rot)
            q, k = qk[:, : self.hq], qk[:, self.hq :]
        else:
            q = apply_rope(self.q_norm(qkv[:, : self.q_size].view(t, self.hq, self.d)), rot)
            k = apply_rope(self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.hkv, self.d)), rot)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window, self.softcap, self.sinks)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.inter = spec.intermediate_size
        self.activation = spec.activation
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * self.inter, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(self.inter, spec.hidden_size, bias=spec.mlp_bias)
        self.fused: Callable[..., torch.Tensor] | None = None  # (gate_up [T, 2I]) -> silu(gate) * up: the fused CPU kernel
        # the whole MLP as one callable where a weight format fuses across its layers (w8a8:
        # engine_workers.kernels.w8a8_linear.W8A8GatedMLP); it takes precedence over ``fused``
        self.gated: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated is not None:
            return self.gated(x)
        gate_up = self.gate_up_proj(x)
        if self.fused is not None:
            return self.down_proj(self.fused(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    """Names are Llama's: ``input_layernorm`` before attention, ``post_attention_layernorm`` before
    the MLP (both absent without ``spec.pre_norms``); ``attn_out_norm`` and ``mlp_out_norm`` norm
    the attention and MLP outputs before their residual add (``spec.post_norms``: Gemma 2's
    sandwich, OLMo 2's post-norms; the loader maps their checkpoint names)."""

    def __init__(self, spec: ModelSpec, index: int = 0) -> None:
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        window = spec.layer_windows[index] if spec.layer_windows else None
        # which of the model's rotations this layer takes (Gemma 3: its own RoPE for sliding layers)
        self.rope_key = "sliding" if spec.local_rope and window is not None else "full"
        self.input_layernorm = RMSNorm(hidden, eps) if spec.pre_norms else None
        self.self_attn: Attention | MlaAttention = (
            MlaAttention(spec.mla, hidden, lambda dim: RMSNorm(dim, eps)) if spec.mla is not None
            else Attention(spec, window))
        self.post_attention_layernorm = RMSNorm(hidden, eps) if spec.pre_norms else None
        moe = spec.moe
        self.mlp: MLP | SparseMoeBlock = (
            moe.block(spec.hidden_size) if moe is not None and moe.sparse_layers[index]
            else MLP(spec))
        self.attn_out_norm = RMSNorm(hidden, eps) if spec.post_norms else None
        self.mlp_out_norm = RMSNorm(hidden, eps) if spec.post_norms else None

    def forward(self, residual, delta, rot, k_cache, v_cache, meta):
        """Adds ``delta`` (the previous layer's MLP output, None for the first layer) to the
        residual stream in place and returns this layer's MLP output: the residual add is fused
        into the norm that follows it (as vLLM does), which is one pass with the CPU kernel."""
        h = _add_norm(self.input_layernorm, residual, delta)
        h = self.self_attn(h, rot, k_cache, v_cache, meta)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        out = self.mlp(_add_norm(self.post_attention_layernorm, residual, h))
        return self.mlp_out_norm(out) if self.mlp_out_norm is not None else out


def _add_norm(norm: RMSNorm | None, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """``residual += delta`` in place, then ``norm`` of it; without a norm (OLMo 2 has no pre-norms),
    the residual stream itself, which no layer writes into."""
    if norm is not None:
        return norm.add_forward(residual, delta)
    if delta is not None:
        residual.add_(delta)
    return residual


class LlamaForPagedLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # None = tied: the LM head reads the embedding matrix. With packed CPU linears
        # (engine_workers.kernels.cpu_linear) the loader sets a packed copy of it here instead; the
        # embedding lookup keeps the plain one.
        self.lm_head: nn.Module | None = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # Plain attributes, not buffers: the module is built on the meta device and the tables are
        # created afterwards, on the target device, by ``set_rope`` / ``set_ropes`` (complex, see rope.py).
        self.ropes: dict[str, Rope] = {}

    def set_rope(self, table: torch.Tensor) -> None:
        """One fixed table ``[L, D/2]`` complex for every layer."""
        self.ropes = {"full": Rope(table)}

    def set_ropes(self, cfg, max_len: int, device: torch.device) -> None:
        """Every rotation ``cfg`` asks for (its RoPE scaling type; Gemma 3's local RoPE for the
        sliding layers), for contexts up to ``max_len``."""
        if self.spec.local_rope:
            self.ropes = {"full": build_rope(cfg, self.spec.head_dim, max_len, device, "full_attention"),
                          "sliding": build_rope(cfg, self.spec.head_dim, max_len, device, "sliding_attention")}
        else:
            self.ropes = {"full": build_rope(cfg, self.spec.head_dim, max_len, device)}

    @property
    def rope_table(self) -> torch.Tensor | None:
        """The fixed table of the full-attention layers (None before ``set_rope``)."""
        rope = self.ropes.get("full")
        return rope.base if rope is not None else None

    @property
    def needs_seq_ends(self) -> bool:
        """Whether ``forward`` needs ``AttnMetadata.seq_ends`` (longrope, dynamic RoPE)."""
        return any(r.needs_ends for r in self.ropes.values())

    def use_fused(self, ops: FusedOps | None) -> None:
        """Run the layer norms (with their residual adds) and the SiLU gating on ``ops``
        (:class:`engine_workers.kernels.cpu_kernels.FusedOps`), or back on torch ops with ``None``."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if norm is not None:
                    norm.fused = ops.add_rms_norm if ops else None
            if isinstance(layer.mlp, MLP) and layer.mlp.activation == "silu":  # the kernel gates with SiLU only
                layer.mlp.fused = ops.silu_mul if ops else None
        self.norm.fused = ops.add_rms_norm if ops else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttnMetadata,
        logit_rows: torch.Tensor,  # [S] rows whose next-token logits are needed
        hidden_out: list[torch.Tensor] | None = None,  # given: the rows' final-norm states [S, hidden] appended
        sum_spans: list[tuple[int, int]] | None = None,  # (first row, rows) whose final-norm states are summed
        sums_out: list[torch.Tensor] | None = None,  # given with sum_spans: those sums [len(spans), hidden] appended
        states_out: list[torch.Tensor] | None = None,  # given: every row's last hidden state before the final norm [T, hidden]
    ) -> torch.Tensor:
        residual = self.embed(input_ids)  # a fresh tensor: the layers add into it in place
        if self.spec.embed_scale is not None:
            # Gemma: the scale rounded to the model dtype first, as transformers does
            residual.mul_(torch.tensor(self.spec.embed_scale, dtype=residual.dtype))
        assert self.ropes, "set_rope() first"
        rots = {key: rope.rotations(positions, meta.seq_ends) for key, rope in self.ropes.items()}
        delta = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            assert isinstance(layer, DecoderLayer)
            delta = layer(residual, delta, rots[layer.rope_key], k_cache, v_cache, meta)
        assert delta is not None  # a model has layers
        if sum_spans is not None and sums_out is not None:
            sums_out.append(self._span_sums(residual, delta, sum_spans))
        if states_out is not None:  # MTP speculation reads them (engine_workers.model.models.mtp)
            states_out.append((residual + delta).float())
        x = self.norm.add_forward(residual.index_select(0, logit_rows), delta.index_select(0, logit_rows))
        if hidden_out is not None:
            hidden_out.append(x.float())
        logits = (self.lm_head(x) if self.lm_head is not None else F.linear(x, self.embed_tokens.weight)).float()
        if self.spec.final_softcap is not None:
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input rows (an MTP module replaces it: models/mtp.py)."""
        return self.embed_tokens(input_ids)

    def _span_sums(self, residual: torch.Tensor, delta: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Per span, the sum of its rows' final-norm states (float32). The norm runs on copies
        (index_select), so the residual stream the logit rows read is left as it is."""
        out = torch.zeros((len(spans), residual.shape[-1]), dtype=torch.float32, device=residual.device)
        if not spans:
            return out
        rows = torch.cat([torch.arange(a, a + n, device=residual.device) for a, n in spans])
        which = torch.repeat_interleave(torch.arange(len(spans), device=residual.device),
                                        torch.tensor([n for _, n in spans], device=residual.device))
        states = self.norm.add_forward(residual.index_select(0, rows), delta.index_select(0, rows))
        return out.index_add_(0, which, states.float())
