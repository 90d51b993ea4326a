"""Checkpoint layouts: sharded safetensors with an index file, tied and untied embeddings, bf16
weights; greedy tokens equal transformers' on each, and a broken layout is refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch

from devtools.tiny_model import build_tokenizer
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.loading.loader import load_model
from lockgate_types import SamplingParams
from tokenization.model_store import ModelError


def save(out, tie: bool, dtype: torch.dtype = torch.float32, shard: str | None = "40KB"):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer()
    cfg = AutoConfig.for_model("llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                               tie_word_embeddings=tie, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(out, max_shard_size=shard) if shard else model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def hf_tokens(path, prompts, n):
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            generation_config=cfg)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize(("tie", "dtype"), [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_sharded_checkpoint_matches_hf(tmp_path, tie, dtype):
    path = save(tmp_path / "m", tie, dtype)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the checkpoint is sharded"
    assert ("lm_head.weight" in index["weight_map"]) == (not tie)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 30)]
    engine = Engine(EngineConfig(model=str(path), kv_cache_bytes=4 << 20))
    assert engine.loaded.spec.tie_word_embeddings == tie
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [list(o.token_ids) for o in got] == hf_tokens(path, prompts, 12)


def test_missing_shard_refused_by_name(tmp_path):
    path = save(tmp_path / "m", tie=False)
    shard = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(ModelError, match=shard):
        load_model(str(path), torch.float32, torch.device("cpu"))


def test_untied_checkpoint_without_head_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save(tmp_path / "m", tie=False, shard=None)
    weights = load_file(str(path / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="lm_head.weight"):
        load_model(str(path), torch.float32, torch.device("cpu"))
