"""Mixture-of-experts execution: each family's router (:func:`route`) and the experts run grouped
(:class:`GroupedExperts`): the batch's (token, expert) pairs are sorted by expert once, so every
active expert runs one gate/up GEMM and one down GEMM over all of its rows, and the weighted rows
are scattered back with one ``index_add_``. The Python loop is over the active experts (at most
``num_experts`` iterations per layer, whatever the batch size), never over tokens.

Routers (``Router.kind``), as each family's reference computes them:

* ``softmax_topk`` (Mixtral; Qwen3-MoE): softmax over all experts in float32, top-k of the
  probabilities; ``renormalize`` divides the k by their sum (Mixtral always, Qwen3-MoE where
  ``norm_topk_prob``).
* ``topk_softmax`` (gpt-oss): the router has a bias; top-k of the logits, softmax over those k.
* ``sigmoid_group`` (DeepSeek-V3): sigmoid scores; the experts are chosen on score plus
  ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups (a group scored by
  its two best), weighted by the uncorrected scores, renormalised where asked, times
  ``routed_scaling_factor``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ROUTER_KINDS = ("softmax_topk", "topk_softmax", "sigmoid_group")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    kind: str
    num_experts: int
    top_k: int
    renormalize: bool = True
    bias: bool = False  # a bias on the router linear (gpt-oss)
    n_group: int = 1  # sigmoid_group only
    topk_group: int = 1
    scaling: float = 1.0  # routed_scaling_factor

    def __post_init__(self) -> None:
        if self.kind not in ROUTER_KINDS:
            raise ValueError(f"router kind {self.kind!r} is not one of {', '.join(ROUTER_KINDS)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_group={self.n_group}, topk_group={self.topk_group} do not divide {self.num_experts} experts")


def route(logits: torch.Tensor, spec: RouterSpec, correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [T, E] (bias already added) -> (weights [T, k] float32, expert ids [T, k] int64)."""
    if spec.kind == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)
        if spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if spec.kind == "topk_softmax":
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    scores = logits.float().sigmoid()
    choice = scores if correction is None else scores + correction.float()
    t = scores.shape[0]
    if spec.n_group > 1:
        grouped = choice.view(t, spec.n_group, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(spec.topk_group, dim=-1).indices, 1.0)
        mask = keep.unsqueeze(-1).expand_as(grouped).reshape(t, -1)
        # -inf, not 0: a corrected score can be negative, and a zeroed expert would outrank it
        choice = choice.masked_fill(mask == 0, float("-inf"))
    ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.scaling, ids


class Router(nn.Module):
    def __init__(self, hidden: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(spec.num_experts)) if spec.bias else None
        # DeepSeek-V3's selection-only bias
        self.correction = nn.Parameter(torch.empty(spec.num_experts)) if spec.kind == "sigmoid_group" else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec.kind == "sigmoid_group":  # DeepSeek scores in float32 (its router's own cast)
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight, self.bias)
        return route(logits, self.spec, self.correction)


def swiglu_clamped(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's gating: gate and up interleaved along the last dim, both clamped, ``(up + 1) *
    gate * sigmoid(alpha * gate)``."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GroupedExperts(nn.Module):
    """``num_experts`` gated MLPs stored stacked: ``gate_up`` [E, 2I, H] (gate rows then up rows,
    or interleaved for ``activation="swiglu_clamped"``), ``down`` [E, H, I], optional biases. After
    :meth:`use_linears` each expert runs on its own pair of linear modules instead (the CPU
    low-precision weight formats) and the stacked weights are gone."""

    def __init__(self, num_experts: int, hidden: int, inter: int, activation: str = "silu", bias: bool = False,
                 alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        if activation not in ("silu", "swiglu_clamped"):
            raise ValueError(f"expert activation {activation!r} is not implemented")
        self.num_experts, self.inter, self.activation = num_experts, inter, activation
        self.alpha, self.limit = alpha, limit  # swiglu_clamped only
        self.gate_up: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * inter)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        # per expert its gate_up and its down module, set by use_linears; None = the stacked weights above
        self.gate_up_linears: nn.ModuleList | None = None
        self.down_linears: nn.ModuleList | None = None
        # per expert the whole expert as one callable where a weight format fuses its two layers
        # (w8a8's W8A8GatedMLP, SiLU experts only); takes precedence over ``linears``
        self.gated: list[Callable[[torch.Tensor], torch.Tensor]] | None = None

    def use_linears(self, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module],
                    gated: Callable[[nn.Module, nn.Module], Callable[[torch.Tensor], torch.Tensor]] | None = None) -> int:
        """Move every expert onto ``make(weight, bias)`` modules, one for gate/up and one for down,
        and drop the stacked weights (the model then holds only the new copy); with ``gated`` and
        SiLU experts, each expert runs as ``gated(gate_up, down)``. Returns the modules made."""
        assert self.gate_up is not None and self.down is not None, "use_linears once"
        gu, dn, gub, dnb = self.gate_up, self.down, self.gate_up_bias, self.down_bias
        ups = nn.ModuleList(make(gu[e], None if gub is None else gub[e]) for e in range(self.num_experts))
        downs = nn.ModuleList(make(dn[e], None if dnb is None else dnb[e]) for e in range(self.num_experts))
        self.gate_up_linears, self.down_linears = ups, downs
        if gated is not None and self.activation == "silu":
            self.gated = [gated(up, down) for up, down in zip(ups, downs)]
        for name in ("gate_up", "down", "gate_up_bias", "down_bias"):
            if name in self._parameters:
                self.register_parameter(name, None)
        return 2 * self.num_experts

    def _expert(self, e: int, seg: torch.Tensor) -> torch.Tensor:
        if self.gated is not None:
            return self.gated[e](seg)
        if self.gate_up_linears is not None and self.down_linears is not None:
            return self.down_linears[e](self._act(self.gate_up_linears[e](seg)))
        assert self.gate_up is not None and self.down is not None
        h = F.linear(seg, self.gate_up[e], None if self.gate_up_bias is None else self.gate_up_bias[e])
        return F.linear(self._act(h), self.down[e], None if self.down_bias is None else self.down_bias[e])

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu_clamped":
            return swiglu_clamped(gate_up, self.alpha, self.limit)
        gate, up = gate_up.split(self.inter, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H], ``weights``/``ids`` [T, k] -> sum over k of weight * expert(x) [T, H]."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        # stable: within an expert, rows keep token order (deterministic accumulation)
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, tokens)
        out_rows = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            out_rows[start : start + n] = self._expert(e, rows[start : start + n])
            start += n
        out_rows.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out_rows.dtype))
        out = torch.zeros_like(x)
        out.index_add_(0, tokens, out_rows)
        return out


class SparseMoeBlock(nn.Module):
    """Router plus grouped experts, plus an always-on shared expert where the family has one
    (DeepSeek-V3: a plain gated MLP of ``shared_inter`` added unweighted)."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        router: RouterSpec,
        activation: str = "silu",
        expert_bias: bool = False,
        shared_inter: int = 0,
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None:
        super().__init__()
        self.router = Router(hidden, router)
        self.experts = GroupedExperts(router.num_experts, hidden, inter, activation, expert_bias, alpha, limit)
        self.shared = GroupedExperts(1, hidden, shared_inter) if shared_inter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        out = self.experts(x, weights, ids)
        if self.shared is not None:
            zero = torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device)
            out = out + self.shared(x, torch.ones(x.shape[0], 1, device=x.device), zero)
        return out
