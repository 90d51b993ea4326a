"""Every supported Llama-family variant loads through the real loader and matches HF generate():
Mistral, Qwen2 (QKV bias), Qwen3 (per-head q/k norm), tied embeddings, and RoPE scaling from the
config (llama3 and linear)."""

from __future__ import annotations

import random

import pytest
import torch

from devtools.tiny_model import build_tiny_model, build_tokenizer
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from lockgate_types import SamplingParams

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, rms_norm_eps=1e-5)


def save(model_cls, config, out):
    tok = build_tokenizer()
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    model_cls(config).to(torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def variant(name: str, out):
    if name == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        return save(MistralForCausalLM, MistralConfig(**SMALL, sliding_window=None), out)
    if name == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return save(Qwen2ForCausalLM, Qwen2Config(**SMALL), out)
    if name == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return save(Qwen3ForCausalLM, Qwen3Config(**SMALL, head_dim=16), out)
    if name == "llama-tied":
        return build_tiny_model(out, tie_word_embeddings=True)
    if name == "llama3-rope":
        return build_tiny_model(out, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 128})
    if name == "linear-rope":
        return build_tiny_model(out, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "llama-tied", "llama3-rope", "linear-rope"])
def test_variant_matches_hf_generate(name, tmp_path):
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = variant(name, tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 37, 200)]
    engine = Engine(EngineConfig(model=str(path), kv_cache_bytes=8 << 20))
    if name == "qwen2":
        assert engine.loaded.spec.attention_bias
    if name == "qwen3":
        assert engine.loaded.spec.qk_norm
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    cfg = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    for p, out in zip(prompts, got):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, len(p):].tolist()
        assert list(out.token_ids) == ref, f"{name}: prompt of {len(p)} tokens differs"
