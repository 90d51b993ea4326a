"""Grouped MoE execution (engine_workers.model.models.moe) against a naive per-token reference and against
transformers' own routers and MoE blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_workers.model.models.moe import GroupedExperts, RouterSpec, SparseMoeBlock, route, swiglu_clamped


def _naive(x, experts: GroupedExperts, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = experts.gate_up[e] @ x[t]
            if experts.gate_up_bias is not None:
                h = h + experts.gate_up_bias[e]
            if experts.activation == "silu":
                a = F.silu(h[: experts.inter]) * h[experts.inter :]
            else:
                a = swiglu_clamped(h)
            y = experts.down[e] @ a
            if experts.down_bias is not None:
                y = y + experts.down_bias[e]
            out[t] += weights[t, j] * y
    return out


def _init(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.3


@pytest.mark.parametrize(("activation", "bias"), [("silu", False), ("swiglu_clamped", True)])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_grouped_experts_match_naive_reference(activation, bias, tokens):
    experts = GroupedExperts(6, 16, 12, activation, bias)
    _init(experts)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 16, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    got = experts(x, weights, ids)
    torch.testing.assert_close(got, _naive(x, experts, weights, ids), rtol=1e-5, atol=1e-5)


def test_grouped_experts_run_one_matmul_per_active_expert(monkeypatch):
    """Grouping, not a per-token loop: the number of gate/up GEMMs is the number of experts hit."""
    experts = GroupedExperts(8, 16, 12)
    _init(experts)
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k))[1])
    x = torch.randn(64, 16)
    ids = torch.tensor([[0, 3]] * 32 + [[3, 5]] * 32)
    experts(x, torch.ones(64, 2), ids)
    assert len(calls) == 2 * 3  # experts 0, 3, 5: gate/up and down each
    assert sorted(calls[::2]) == [32, 32, 64]


def test_softmax_topk_matches_transformers_routers():
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    x = torch.randn(20, 16)
    for norm in (False, True):
        cfg = AutoConfig.for_model("qwen3_moe", hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
        ref = Qwen3MoeTopKRouter(cfg)
        _init(ref)
        _, w_ref, i_ref = ref(x)
        w, i = route(F.linear(x, ref.weight), RouterSpec("softmax_topk", 8, 3, renormalize=norm))
        assert torch.equal(i, i_ref)
        torch.testing.assert_close(w, w_ref)
    cfg = AutoConfig.for_model("mixtral", hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
    ref = MixtralTopKRouter(cfg)
    _init(ref)
    _, w_ref, i_ref = ref(x)
    w, i = route(F.linear(x, ref.weight), RouterSpec("softmax_topk", 8, 2))
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref)


def test_topk_softmax_matches_gpt_oss_router():
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = AutoConfig.for_model("gpt_oss", hidden_size=16, num_local_experts=8, num_experts_per_tok=4)
    ref = GptOssTopKRouter(cfg)
    _init(ref)
    x = torch.randn(20, 16)
    out = ref(x)
    w_ref, i_ref = out[-2], out[-1]
    w, i = route(F.linear(x, ref.weight, ref.bias), RouterSpec("topk_softmax", 8, 4, bias=True))
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref.to(w.dtype))


def test_sigmoid_group_matches_deepseek_v3_router():
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=8,
        n_shared_experts=1,
    )
    ref = DeepseekV3MoE(cfg)
    _init(ref)
    x = torch.randn(20, 16)
    out = ref.gate(x)
    w_ref, i_ref = out[-2], out[-1]
    spec = RouterSpec("sigmoid_group", 16, 4, n_group=4, topk_group=2, scaling=2.5)
    w, i = route(F.linear(x, ref.gate.weight), spec, ref.gate.e_score_correction_bias)
    order_ref, order = i_ref.sort(-1), i.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices).float())


def test_sigmoid_group_with_negative_correction_keeps_to_the_chosen_groups():
    """A correction bias below -1 makes every corrected score negative: experts of the groups not
    chosen must still lose to them (masked to -inf, as DeepSeek's router does, not to 0)."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = AutoConfig.for_model("deepseek_v3", hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                               topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    ref = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 16, generator=gen))
        ref.e_score_correction_bias.copy_(-2.0 + 0.1 * torch.randn(16, generator=gen))
    x = torch.randn(30, 16, generator=gen)
    _, w_ref, i_ref = ref(x)
    spec = RouterSpec("sigmoid_group", 16, 4, n_group=4, topk_group=2, scaling=2.5)
    w, i = route(F.linear(x, ref.weight), spec, ref.e_score_correction_bias)
    assert torch.equal(i.sort(-1).values, i_ref.sort(-1).values)
    groups = (i // 4).unique(dim=None)
    assert all(len((row // 4).unique()) <= 2 for row in i)  # at most topk_group groups per token
    assert groups.numel() > 2  # different tokens choose different groups
    torch.testing.assert_close(w.gather(1, i.sort(-1).indices), w_ref.gather(1, i_ref.sort(-1).indices))


def test_block_matches_transformers_qwen3_moe_block():
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True
    )
    ref = Qwen3MoeSparseMoeBlock(cfg)
    _init(ref)
    ours = SparseMoeBlock(16, 12, RouterSpec("softmax_topk", 8, 2))
    ours.router.weight.data = ref.gate.weight.data
    ours.experts.gate_up.data = ref.experts.gate_up_proj.data
    ours.experts.down.data = ref.experts.down_proj.data
    x = torch.randn(30, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x.unsqueeze(0))[0], rtol=1e-5, atol=1e-5)


def test_router_spec_refuses_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        RouterSpec("softmax_topk", 4, 5)
    with pytest.raises(ValueError, match="router kind"):
        RouterSpec("greedy", 4, 1)


def test_clamped_swiglu_experts_match_gpt_oss_experts():
    """gpt-oss's experts (interleaved gate/up, biases, the clamp at ``swiglu_limit`` reached by
    large inputs) on transformers' [E, H, 2I] layout, transposed as the loader does."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = AutoConfig.for_model("gpt_oss", hidden_size=16, intermediate_size=12, num_local_experts=4, swiglu_limit=5.0)
    ref = GptOssExperts(cfg)
    _init(ref)
    ours = GroupedExperts(4, 16, 12, "swiglu_clamped", bias=True, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    ours.gate_up.data = ref.gate_up_proj.data.transpose(1, 2).contiguous()
    ours.gate_up_bias.data = ref.gate_up_proj_bias.data
    ours.down.data = ref.down_proj.data.transpose(1, 2).contiguous()
    ours.down_bias.data = ref.down_proj_bias.data
    x = torch.randn(25, 16) * 4
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(25)])
    weights = torch.softmax(torch.randn(25, 2), -1)
    with torch.no_grad():
        gate_up = F.linear(x, ours.gate_up[0], ours.gate_up_bias[0])
        assert gate_up.abs().max() > cfg.swiglu_limit  # the clamp is exercised
        torch.testing.assert_close(ours(x, weights, ids), ref(x, ids, weights), rtol=1e-5, atol=1e-4)
