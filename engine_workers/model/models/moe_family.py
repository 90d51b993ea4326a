"""The MoE families on the shared decoder (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3): which config fields they
read, which layers are sparse, and the mapping of their checkpoints' expert weights onto
:class:`engine_workers.model.models.moe.SparseMoeBlock`.

Attention is the dense families' (Mixtral is Mistral's, Qwen3-MoE is Qwen3's with QK-norm); only the
MLP of a sparse layer differs. Checkpoints store experts either one module per expert (the names
transformers saves: ``experts.{e}.w1/w3/w2`` for Mixtral, ``experts.{e}.gate_proj/up_proj/down_proj``
for Qwen3-MoE) or already stacked (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
[E, H, I]); both are read. gpt-oss stores its experts stacked the other way round (``[E, H, 2I]``
with gate and up interleaved, ``[E, I, H]``) with biases, and its router has a bias. DeepSeek-V3's
first ``first_k_dense_replace`` layers are dense; the rest route with ``sigmoid_group`` (its
``e_score_correction_bias`` chooses, the scores weigh) and add ``n_shared_experts`` always-on experts,
stored as one MLP of ``n_shared_experts * moe_intermediate_size``. Its attention is MLA (mla.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_workers.model.models.moe import RouterSpec, SparseMoeBlock
from engine_workers.model.models.split import Split

MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")

# Per family: the fields its spec reads beyond the dense ones it shares (spec._COMMON plus these).
MOE_READ = {
    "mixtral": frozenset({"sliding_window", "num_local_experts", "num_experts_per_tok"}),
    "qwen3_moe": frozenset({"sliding_window", "layer_types", "attention_bias", "num_local_experts", "num_experts",
                            "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                            "mlp_only_layers"}),
    "gpt_oss": frozenset({"sliding_window", "layer_types", "attention_bias", "num_local_experts",
                          "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"}),
    "deepseek_v3": frozenset({"first_k_dense_replace", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                              "moe_intermediate_size", "norm_topk_prob", "n_group", "topk_group",
                              "routed_scaling_factor", "topk_method", "scoring_func", "moe_layer_freq"}),
}
# Training-only: the auxiliary load-balancing loss and router noise never change an inference forward
# (transformers applies the jitter only with ``self.training``).
# DeepSeek's hub configs add its own training losses (aux_loss_alpha, seq_aux) and the expert-parallel
# degree it was trained with (ep_size: where experts run, not what they compute).
MOE_INERT = frozenset({"output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "aux_loss_alpha",
                       "seq_aux", "ep_size"})
# DeepSeek's hub configs name the router lockgate runs; any other value is another router.
_DEEPSEEK_FIXED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}


@dataclass(frozen=True, slots=True)
class MoeSpec:
    router: RouterSpec
    inter: int  # each expert's intermediate size
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense MLP (False)
    prefix: str  # the sparse block's checkpoint module name under ``model.layers.{i}.``
    names: tuple[str, str, str]  # per-expert gate, up, down module names
    activation: str = "silu"  # or "swiglu_clamped" (gpt-oss)
    expert_bias: bool = False
    alpha: float = 1.702  # swiglu_clamped's
    limit: float = 7.0
    shared_inter: int = 0  # the always-on shared experts' intermediate size (DeepSeek-V3), 0 = none

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    def block(self, hidden: int) -> SparseMoeBlock:
        return SparseMoeBlock(hidden, self.inter, self.router, self.activation, self.expert_bias,
                              shared_inter=self.shared_inter, alpha=self.alpha, limit=self.limit)


def moe_spec(cfg) -> MoeSpec | None:
    """The MoE part of ``cfg`` (None for a dense family); ValueError naming the field it cannot run."""
    model_type = cfg.model_type
    if model_type not in MOE_ARCHITECTURES:
        return None
    n = cfg.num_hidden_layers
    experts = (getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
               or getattr(cfg, "n_routed_experts", None))
    if not experts:
        raise ValueError("config field num_local_experts is missing or 0")
    top_k = cfg.num_experts_per_tok
    if not 0 < top_k <= experts:
        raise ValueError(f"config field num_experts_per_tok={top_k} must be in 1..{experts}")
    if model_type == "gpt_oss":
        return MoeSpec(RouterSpec("topk_softmax", experts, top_k, bias=True), cfg.intermediate_size, (True,) * n,
                       "mlp", ("", "", ""), "swiglu_clamped", True, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))
    if model_type == "deepseek_v3":
        return _deepseek_spec(cfg, experts, top_k)
    if model_type == "mixtral":
        return MoeSpec(RouterSpec("softmax_topk", experts, top_k, renormalize=True), cfg.intermediate_size,
                       (True,) * n, "block_sparse_moe", ("w1", "w3", "w2"))
    step = getattr(cfg, "decoder_sparse_step", 1) or 0
    if step <= 0:
        raise ValueError(f"config field decoder_sparse_step={step!r} must be >= 1")
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    if not dense <= set(range(n)):
        raise ValueError(f"config field mlp_only_layers={sorted(dense)} names layers beyond the {n} there are")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    return MoeSpec(RouterSpec("softmax_topk", experts, top_k, renormalize=bool(cfg.norm_topk_prob)),
                   cfg.moe_intermediate_size, sparse, "mlp", ("gate_proj", "up_proj", "down_proj"))


def _deepseek_spec(cfg, experts: int, top_k: int) -> MoeSpec:
    n = cfg.num_hidden_layers
    for name, value in _DEEPSEEK_FIXED.items():
        got = getattr(cfg, name, value)
        if got != value:
            raise ValueError(f"config field {name}={got!r} is not implemented (only {value!r}: DeepSeek-V3's "
                             "sigmoid scores, grouped top-k on the corrected scores, every layer after the dense ones MoE)")
    dense = cfg.first_k_dense_replace or 0
    if not 0 <= dense <= n:
        raise ValueError(f"config field first_k_dense_replace={dense} must be in 0..{n}")
    groups, topk_group = cfg.n_group or 1, cfg.topk_group or 1
    if experts % groups or not 0 < topk_group <= groups:
        raise ValueError(f"config fields n_group={groups}, topk_group={topk_group} do not split {experts} experts")
    if groups > 1 and experts // groups < 2:  # a group is scored by its two best experts
        raise ValueError(f"config field n_group={groups} leaves fewer than 2 experts per group")
    if top_k > topk_group * (experts // groups):
        raise ValueError(f"config field num_experts_per_tok={top_k} exceeds the {topk_group * (experts // groups)} "
                         "experts of the topk_group groups chosen")
    shared = cfg.n_shared_experts or 0
    if shared < 0:
        raise ValueError(f"config field n_shared_experts={shared} must be >= 0")
    router = RouterSpec("sigmoid_group", experts, top_k, renormalize=bool(cfg.norm_topk_prob), n_group=groups,
                        topk_group=topk_group, scaling=float(cfg.routed_scaling_factor))
    return MoeSpec(router, cfg.moe_intermediate_size, tuple(i >= dense for i in range(n)), "mlp",
                   ("gate_proj", "up_proj", "down_proj"), shared_inter=shared * cfg.moe_intermediate_size)


def map_moe_state(take: Callable[..., torch.Tensor], has: Callable[[str], bool], moe: MoeSpec, src: str,
                  dst: str) -> dict[str, torch.Tensor]:
    """Layer ``src``'s (``model.layers.{i}.``) sparse-block weights as our ``dst`` names
    (engine_workers.model.models.moe.SparseMoeBlock under ``mlp.``). ``take(name, split)``: each expert
    tensor is tagged with its tensor-parallel split, by tensor: every rank reads a slice of every
    expert's intermediate rows (:mod:`engine_workers.model.loading.sharding.slices`); routers are whole."""
    base = src + moe.prefix + "."
    if moe.activation == "swiglu_clamped":  # gpt-oss: [E, H, 2I] and [E, I, H], x @ W, with biases
        return {dst + "mlp.router.weight": take(base + "router.weight"),
                dst + "mlp.router.bias": take(base + "router.bias"),
                dst + "mlp.experts.gate_up": take(base + "experts.gate_up_proj",
                                                  Split("paired", 2, "moe")).transpose(1, 2).contiguous(),
                dst + "mlp.experts.gate_up_bias": take(base + "experts.gate_up_proj_bias", Split("paired", 1, "moe")),
                dst + "mlp.experts.down": take(base + "experts.down_proj",
                                               Split("inter", 1, "moe")).transpose(1, 2).contiguous(),
                dst + "mlp.experts.down_bias": take(base + "experts.down_proj_bias")}
    rows, cols = Split("inter", 0, "moe"), Split("inter", 1, "moe")
    out = {dst + "mlp.router.weight": take(base + "gate.weight")}
    if moe.router.kind == "sigmoid_group":  # DeepSeek-V3: the selection bias and the shared experts
        out[dst + "mlp.router.correction"] = take(base + "gate.e_score_correction_bias")
        if moe.shared_inter:
            shared, srows = base + "shared_experts.", Split("inter", 0, "shared")
            out[dst + "mlp.shared.gate_up"] = torch.cat([take(shared + "gate_proj.weight", srows),
                                                         take(shared + "up_proj.weight", srows)])[None]
            out[dst + "mlp.shared.down"] = take(shared + "down_proj.weight", Split("inter", 1, "shared"))[None]
    if has(base + "experts.gate_up_proj"):  # already stacked: [E, 2I, H] and [E, H, I]
        out[dst + "mlp.experts.gate_up"] = take(base + "experts.gate_up_proj", Split("gated", 1, "moe"))
        out[dst + "mlp.experts.down"] = take(base + "experts.down_proj", Split("inter", 2, "moe"))
        return out
    gate, up, down = moe.names
    per = [base + f"experts.{e}." for e in range(moe.num_experts)]
    out[dst + "mlp.experts.gate_up"] = torch.stack(
        [torch.cat([take(p + f"{gate}.weight", rows), take(p + f"{up}.weight", rows)]) for p in per])
    out[dst + "mlp.experts.down"] = torch.stack([take(p + f"{down}.weight", cols) for p in per])
    return out
