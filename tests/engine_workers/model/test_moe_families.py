"""MoE families (Mixtral, Qwen3-MoE, gpt-oss), each a tiny random float32 checkpoint saved by transformers,
loaded through lockgate's loader and served by the real engine and paged cache: greedy tokens equal
transformers' ``generate``, logits close, and the same tokens through prefix-cache hits and chunked
prefill; config fields lockgate does not run are refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from devtools.tiny_model import build_tokenizer
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.execution.batch import Chunk, ModelInput
from lockgate_types import SamplingParams
from tokenization.model_store import ModelError

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.2,
             rms_norm_eps=1e-5, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": ("mixtral", dict(num_local_experts=6)),
    "mixtral-window": ("mixtral", dict(num_local_experts=4, sliding_window=24)),
    # layer 1 dense by mlp_only_layers; in "-norm", layers 0 and 2 dense by decoder_sparse_step=2
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=False,
                                    mlp_only_layers=[1])),
    "qwen3_moe-norm": ("qwen3_moe", dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
                                         num_experts_per_tok=3, decoder_sparse_step=2)),
    # alternating sliding/full layers with a window shorter than the long prompts, attention sinks,
    # biases everywhere, clamped SwiGLU (its clamp: test_moe.py), yarn RoPE
    "gpt_oss": ("gpt_oss", dict(num_local_experts=6, sliding_window=24,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def save(name: str, out, **override):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[name]
    tok = build_tokenizer()
    config = AutoConfig.for_model(model_type, **{**SMALL, **extra, **override})
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def hf_greedy(path, prompts, n):
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out.append(hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_moe_family_matches_hf_generate(name, tmp_path):
    path = save(name, tmp_path / name)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 70)]
    ref = hf_greedy(path, prompts, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(path), kv_cache_bytes=8 << 20, block_size=8))
    moe = engine.loaded.spec.moe
    assert moe is not None and any(moe.sparse_layers)
    if "mlp_only_layers" in FAMILIES[name][1] or "decoder_sparse_step" in FAMILIES[name][1]:
        assert not all(moe.sparse_layers)  # a dense layer among the sparse ones
    assert_paths_match(engine, path, prompts, params, ref, name, 8 << 20)


def assert_paths_match(engine, path, prompts, params, ref, name, kv_bytes):
    """``engine``'s greedy tokens equal ``ref`` (transformers'), again from prefix-cache hits, and
    from a second engine that prefills in chunks of 16 with the prefix cache off."""
    got = [list(o.token_ids) for o in engine.generate(prompts, params)]
    assert got == ref, f"{name}: differs from transformers"
    hits = engine.generate(prompts, params)
    assert min(o.num_cached_tokens for o in hits[1:]) > 0
    assert [list(o.token_ids) for o in hits] == ref, f"{name}: prefix-cache hits changed the tokens"
    chunked = Engine(EngineConfig(model=str(path), kv_cache_bytes=kv_bytes, block_size=8,
                                  long_prefill_token_threshold=16, enable_prefix_caching=False))
    assert [list(o.token_ids) for o in chunked.generate(prompts, params)] == ref, f"{name}: chunked prefill differs"


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe-norm", "gpt_oss"])
def test_moe_family_logits_close_to_hf(name, tmp_path):
    """Every position's logits within 1e-4 (relative to the largest) of transformers' eager float32."""
    from transformers import AutoModelForCausalLM

    from engine_workers.model.execution.runner import ModelRunner
    from engine_workers.model.loading.loader import load_model

    path = save(name, tmp_path / name)
    prompt = random.Random(3).sample(range(3, 512), 60)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    loaded = load_model(str(path), torch.float32, torch.device("cpu"), max_len=256)
    runner = ModelRunner(loaded, num_blocks=16, block_size=8, device=torch.device("cpu"), dtype=torch.float32)
    got = runner.execute(ModelInput((Chunk(prompt, 0, list(range(8)), True),), every_row=True)).logits
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize(("name", "override", "field"), [
    ("qwen3_moe", dict(mlp_only_layers=[7]), "mlp_only_layers"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    ("mixtral", dict(num_experts_per_tok=9), "num_experts_per_tok"),
])
def test_moe_config_refused_naming_field(name, override, field, tmp_path):
    import json

    from engine_workers.model.loading.loader import load_model

    # edited after saving: transformers itself refuses some of these values when building the model
    path = save(name, tmp_path / name)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(override)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=field):
        load_model(str(path), torch.float32, torch.device("cpu"), max_len=64)


def test_unknown_moe_field_refused(tmp_path):
    import json

    from engine_workers.model.loading.loader import load_model

    path = save("mixtral", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["moe_shared_expert_size"] = 16
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="moe_shared_expert_size"):
        load_model(str(path), torch.float32, torch.device("cpu"), max_len=64)
