"""What a dense decoder checkpoint asks of the model layer: :class:`ModelSpec`, parsed from an HF
config, and the refusal of any config field lockgate does not implement.

One decoder (engine_workers.model.models.llama) serves every family; the spec's feature fields say which
of its optional parts a family switches on (docs/design-history.md, "Model families"). A config field is
either *read* (it lands in the spec, its value checked where only some values are implemented),
*inert* (it cannot change a forward pass: dropout, initialisation, token ids, the cache switch), or
refused by name. A field a family's config class defines but that lockgate has not been taught is
refused even at its default value: the default is still an architecture choice the model makes.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_workers.model.models.mla import MLA_READ, MlaSpec, mla_spec
from engine_workers.model.models.moe_family import MOE_ARCHITECTURES, MOE_INERT, MOE_READ, MoeSpec, moe_spec
from engine_workers.model.models.rope import inv_freq

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "phi3",
                           *MOE_ARCHITECTURES)

# Fields of PretrainedConfig itself and others that cannot change a forward pass at inference.
_INERT = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "problem_type",
    "return_dict", "transformers_version", "attention_dropout", "initializer_range", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "embd_pdrop", "resid_pdrop",
    # Llama's pretraining_tp splits the same matmuls into slices: the same function
    "pretraining_tp",
    # Qwen's switches are folded into layer_types and sliding_window by the config class itself
    "use_sliding_window", "max_window_layers",
    # metadata and generation defaults older configs carry
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "torchscript", "tf_legacy_loss",
    "use_return_dict", "pruned_heads", "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "is_decoder", "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "transformers.js_config",
    # DeepSeek-V3's multi-token-prediction modules serve speculative decoding only: the model's own
    # forward never reads them, and the loader reads no layer past num_hidden_layers
    "num_nextn_predict_layers", "num_mtp_layers",
    # the remote-code classes a hub config points to: lockgate never runs them
    "auto_map",
})


def _inert(name: str) -> bool:
    # private metadata (``_model_name_or_path``) and token ids cannot change a forward pass
    return name in _INERT or name in MOE_INERT or name.startswith("_") or name.endswith(("_token_id", "_token_ids"))
_COMMON = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "rope_parameters", "hidden_act",
})
# Per family: the fields its spec reads beyond the common ones.
_READ = {
    "llama": frozenset({"attention_bias", "mlp_bias"}),
    "mistral": frozenset({"sliding_window"}),
    "qwen2": frozenset({"sliding_window", "layer_types"}),
    "qwen3": frozenset({"sliding_window", "layer_types", "attention_bias"}),
    "gemma2": frozenset({"sliding_window", "layer_types", "attention_bias", "attn_logit_softcapping",
                         "final_logit_softcapping", "query_pre_attn_scalar", "hidden_activation",
                         "use_bidirectional_attention"}),
    "gemma3_text": frozenset({"sliding_window", "layer_types", "attention_bias", "attn_logit_softcapping",
                              "final_logit_softcapping", "query_pre_attn_scalar", "hidden_activation",
                              "use_bidirectional_attention", "_sliding_window_pattern"}),
    "olmo2": frozenset({"attention_bias"}),
    "phi3": frozenset({"sliding_window", "original_max_position_embeddings"}),
    **MOE_READ,
    "deepseek_v3": MOE_READ["deepseek_v3"] | MLA_READ,
}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on q, k and v
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # per layer: the sliding window in tokens (the query's own token included), None = full attention
    layer_windows: tuple[int | None, ...] = ()
    qk_norm_full: bool = False  # RMSNorm over the whole q and k projections before RoPE (OLMo 2)
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"
    attn_scale: float | None = None  # None = head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    embed_scale: float | None = None  # the embeddings multiplied by this (Gemma: sqrt(hidden_size))
    pre_norms: bool = True  # RMSNorm before attention and before the MLP (all but OLMo 2)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before their residual add
    norm_offset: bool = False  # RMSNorm scales by (1 + w) (Gemma): the loader adds the 1 to w
    o_proj_bias: bool = False  # a bias on the attention output projection too
    local_rope: bool = False  # sliding layers take their own RoPE parameters (Gemma 3)
    attn_sinks: bool = False  # a learned per-head sink logit in every attention softmax (gpt-oss)
    moe: MoeSpec | None = None  # the sparse MLPs of an MoE family (engine_workers.model.models.moe_family)
    mla: MlaSpec | None = None  # multi-head latent attention instead of q/k/v heads (DeepSeek-V3, mla.py)

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def kv_slot_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The trailing shapes of a layer's two cache tensors per slot: K and V ``(Hkv, head_dim)``
        each, or MLA's latent and RoPE key (:attr:`engine_workers.model.models.mla.MlaSpec.slot_shapes`)."""
        if self.mla is not None:
            return self.mla.slot_shapes
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    @property
    def kv_elems_per_token(self) -> int:
        """Cache elements one token takes across all layers."""
        return self.num_layers * sum(h * d for h, d in self.kv_slot_shapes)

    @classmethod
    def from_hf(cls, cfg) -> ModelSpec:
        """The spec of ``cfg`` (a transformers config); ValueError naming the field for anything
        lockgate does not implement."""
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        check_fields(cfg, model_type)
        gemma = model_type in ("gemma2", "gemma3_text")
        act_field = "hidden_activation" if gemma else "hidden_act"
        act = getattr(cfg, act_field, "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"config field {act_field}={act!r} is not implemented (only {', '.join(_ACTIVATIONS)})")
        if getattr(cfg, "use_bidirectional_attention", None):
            raise ValueError("config field use_bidirectional_attention=True is not implemented (causal only)")
        heads = cfg.num_attention_heads
        hidden = cfg.hidden_size
        local_rope = model_type == "gemma3_text"
        check_rope(cfg, ("full_attention", "sliding_attention") if local_rope else (None,))
        bias = bool(getattr(cfg, "attention_bias", model_type == "qwen2"))
        scalar = getattr(cfg, "query_pre_attn_scalar", None)
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=hidden,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or hidden // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            layer_windows=layer_windows(cfg),
            qk_norm_full=model_type == "olmo2",
            activation=_ACTIVATIONS[act],
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
            final_softcap=getattr(cfg, "final_logit_softcapping", None),
            embed_scale=hidden**0.5 if gemma else None,
            pre_norms=model_type != "olmo2",
            post_norms=gemma or model_type == "olmo2",
            norm_offset=gemma,
            o_proj_bias=bias and model_type != "qwen2",  # Qwen2 biases q, k and v only
            local_rope=local_rope,
            attn_sinks=model_type == "gpt_oss",
            moe=moe_spec(cfg),
            mla=mla_spec(cfg),
        )


def check_rope(cfg, layer_types: tuple[str | None, ...]) -> None:
    """Refuse a RoPE lockgate does not implement (before any weight is read)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for layer_type in layer_types:
        inv_freq(cfg, head_dim, layer_type)


def check_fields(cfg, model_type: str) -> None:
    """Refuse, naming it, any config field that is neither read by this family's spec nor inert."""
    read = _COMMON | _READ[model_type]
    for name in sorted(cfg.to_dict()):
        if name not in read and not _inert(name):
            raise ValueError(f"config field {name!r} is not implemented for {model_type} (lockgate would ignore it "
                             "and compute something else)")


def layer_windows(cfg) -> tuple[int | None, ...]:
    """Per layer, its sliding window or None: ``layer_types`` where the config has it (Gemma's
    alternating layers, Qwen's ``max_window_layers``), else ``sliding_window`` on every layer
    (Mistral, Phi-3)."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return (window,) * n
    if len(types) != n:
        raise ValueError(f"config field layer_types has {len(types)} entries for {n} layers")
    out: list[int | None] = []
    for i, kind in enumerate(types):
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention":
            if not window:
                raise ValueError(f"config field layer_types[{i}] is sliding_attention but sliding_window is {window!r}")
            out.append(int(window))
        else:
            raise ValueError(f"config field layer_types[{i}]={kind!r} is not implemented")
    return tuple(out)
