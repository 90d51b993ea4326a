"""DeepSeek-V3: a tiny random float32 checkpoint saved by transformers, loaded through lockgate's loader and
served by the real engine over the paged cache holding MLA's compressed KV (model/models/mla.py): greedy tokens
equal transformers' ``generate``, also through prefix-cache hits and chunked prefill; logits of the
expanded prefill path and of the absorbed decode path within 1e-4 (relative to the largest logit) of
transformers' eager float32 (measured ~2e-6 relative); the cache holds ``kv_lora_rank + qk_rope_head_dim``
elements per token per layer; config fields lockgate does not run are refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch

from devtools.tiny_model import build_tokenizer
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.execution.batch import Chunk, ModelInput
from engine_workers.model.execution.runner import ModelRunner, kv_block_bytes
from engine_workers.model.loading.loader import load_model
from lockgate_types import SamplingParams
from tests.engine_workers.model.test_moe_families import assert_paths_match, hf_greedy
from tokenization.model_store import ModelError

CPU = torch.device("cpu")
# 4 heads of (16 nope + 8 rope) keys and 12-dim values; latent 32; 8 routed experts in 4 groups, 2
# groups chosen, 2 experts a token, one shared expert; layer 0 dense, layers 1-2 MoE
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
             first_k_dense_replace=1, max_position_embeddings=1024, initializer_range=0.2, rms_norm_eps=1e-5)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256, mscale=1.0,
            mscale_all_dim=1.0, beta_fast=32, beta_slow=1)
VARIANTS = {
    # DeepSeek-V3's own shape: q through its low-rank path, interleaved RoPE dims, YaRN with mscale
    "q_lora-yarn": dict(q_lora_rank=48, rope_parameters=YARN),
    # q straight from the hidden state (DeepSeek-V2-Lite's), half-split RoPE rows, attention biases
    "q_proj-half": dict(q_lora_rank=None, rope_interleave=False, attention_bias=True),
}


def save(name: str, out, **override):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer()
    config = AutoConfig.for_model("deepseek_v3", **{**SMALL, **VARIANTS[name], **override})
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():  # transformers starts the selection bias at 0; a trained one is not
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
            if config.attention_bias:
                for lin in (layer.self_attn.kv_a_proj_with_mqa, layer.self_attn.o_proj):
                    lin.bias.normal_(0.0, 0.2)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_deepseek_matches_hf_generate(name, tmp_path):
    path = save(name, tmp_path / name)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 70)]
    ref = hf_greedy(path, prompts, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(path), kv_cache_bytes=2 << 20, block_size=8))
    spec = engine.loaded.spec
    assert spec.mla is not None and spec.moe is not None and spec.moe.sparse_layers == (False, True, True)
    assert_paths_match(engine, path, prompts, params, ref, name, 2 << 20)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_deepseek_prefill_and_decode_logits_close_to_hf(name, tmp_path):
    """Prefill (expanded K/V) at every position, then decode (absorbed into the query) one token at
    a time over the paged latents, against one transformers forward of the whole sequence."""
    path = save(name, tmp_path / name)
    prompt = random.Random(3).sample(range(3, 512), 60)
    with torch.inference_mode():
        ref = hf_model(path)(torch.tensor([prompt])).logits[0]
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    loaded = load_model(str(path), torch.float32, CPU, max_len=256)
    runner = ModelRunner(loaded, num_blocks=16, block_size=8, device=CPU, dtype=torch.float32)
    got = runner.execute(ModelInput((Chunk(prompt, 0, list(range(8)), True),), every_row=True)).logits
    assert (got - ref).abs().max().item() < tol
    # the block table out of order, so a slot's place in the cache is not its position
    blocks = [5, 2, 7, 0, 3, 6, 1, 4]
    decode = ModelRunner(loaded, num_blocks=8, block_size=8, device=CPU, dtype=torch.float32)
    decode.execute(ModelInput((Chunk(prompt[:48], 0, blocks, True),)))
    for i in range(48, 60):
        row = decode.execute(ModelInput((Chunk(prompt[i : i + 1], i, blocks, True),))).logits[0]
        assert (row - ref[i]).abs().max().item() < tol, f"decode position {i}"


def test_deepseek_cache_holds_the_latent_per_token(tmp_path):
    """Per token per layer the cache holds kv_lora_rank + qk_rope_head_dim values (32 + 8 = 40),
    not the 4 * (24 + 12) = 144 of per-head K/V; the KV budget buys blocks at that size."""
    path = save("q_lora-yarn", tmp_path / "m")
    engine = Engine(EngineConfig(model=str(path), kv_cache_bytes=1 << 20, block_size=8))
    runner, spec = engine.runner, engine.loaded.spec
    assert spec.mla is not None
    slots = runner.num_blocks * runner.block_size
    allocated = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
    per_token = 3 * (32 + 8) * 4  # layers * latent elements * float32
    assert allocated == slots * per_token
    assert kv_block_bytes(spec, 8, torch.float32) == 8 * per_token
    assert runner.num_blocks == (1 << 20) // (8 * per_token)
    assert spec.mla.latent_elems == 40 and spec.mla.expanded_elems == 4 * (16 + 8 + 12)
    assert [tuple(k.shape[1:]) + tuple(v.shape[1:]) for k, v in runner.kv_caches] == [(1, 32, 1, 8)] * 3


def test_deepseek_bf16_kv_cache_halves_the_bytes_and_keeps_tokens(tmp_path):
    path = save("q_lora-yarn", tmp_path / "m")
    prompts = [random.Random(1).sample(range(3, 512), 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = Engine(EngineConfig(model=str(path), kv_cache_bytes=1 << 20, block_size=8))
    bf = Engine(EngineConfig(model=str(path), kv_cache_bytes=1 << 20, block_size=8, kv_cache_dtype="bfloat16"))
    assert bf.runner.num_blocks == 2 * ref.runner.num_blocks
    assert all(t.dtype == torch.bfloat16 for pair in bf.runner.kv_caches for t in pair)
    # the tiny model's top logits are far enough apart that bf16 latents leave the first tokens
    got, want = bf.generate(prompts, params)[0].token_ids, ref.generate(prompts, params)[0].token_ids
    assert list(got[:4]) == list(want[:4])


@pytest.mark.parametrize(("override", "field"), [
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace"),
    (dict(n_group=3), "n_group"),
    (dict(num_experts_per_tok=6), "num_experts_per_tok"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters=dict(rope_type="su", rope_theta=10000.0)), "rope_type"),
    (dict(quantization_config=dict(quant_method="fp8", fmt="e4m3")), "quantization_config"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(topk_method="greedy"), "topk_method"),  # DeepSeek-V2's router
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(moe_shared_expert_size=16), "moe_shared_expert_size"),
])
def test_deepseek_config_refused_naming_field(override, field, tmp_path):
    # edited after saving: transformers itself refuses some of these values when building the model
    path = save("q_lora-yarn", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(override)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=field):
        load_model(str(path), torch.float32, CPU, max_len=64)


def test_deepseek_hub_config_fields_load(tmp_path):
    """The fields DeepSeek-V3's own config.json carries beyond transformers' class load where they
    name what lockgate runs (noaux_tc, sigmoid, every layer MoE) or cannot change a forward."""
    path = save("q_lora-yarn", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1, aux_loss_alpha=0.001,
               seq_aux=True, num_nextn_predict_layers=1,
               auto_map={"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(path), torch.float32, CPU, max_len=64)
    assert loaded.spec.mla is not None and loaded.spec.mla.q_lora_rank == 48
