"""Families beyond plain Llama, each a tiny random checkpoint saved by transformers, loaded through
lockgate's loader and served by the real engine and paged cache: greedy tokens equal transformers'
``generate`` token for token, with prompts longer than the sliding window where there is one, and
the same tokens again through chunked prefill and prefix-cache hits."""

from __future__ import annotations

import random

import pytest
import torch

from devtools.tiny_model import build_tokenizer
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.execution.batch import Chunk, ModelInput
from lockgate_types import SamplingParams

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.2,
             rms_norm_eps=1e-5)
WINDOW = 24  # shorter than the long prompts and than one prompt + its generated tokens

FAMILIES = {
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2-window-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                              final_logit_softcapping=15.0)),
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    "olmo2": ("olmo2", dict()),
    "phi3": ("phi3", dict(sliding_window=WINDOW, pad_token_id=0)),
    # longrope: the short prompts stay within original_max_position_embeddings, the 90-token one
    # starts beyond it (long factors)
    "phi3-longrope": ("phi3", dict(pad_token_id=0, original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "long_factor": [1.0 + 0.6 * j for j in range(8)], "short_factor": [1.0 + 0.05 * j for j in range(8)]})),
}
# transformers rotates a whole longrope sequence by its length (re-computing its cache when it
# crosses the original context); lockgate rotates each chunk by the context it ends at, so a
# chunked prompt longer than the original context differs (docs/design-history.md, RoPE scaling)
CHUNKING_CHANGES_ROPE = {"phi3-longrope"}


def save(name: str, out, families=None, small=None):
    """A tiny random checkpoint of ``families[name]`` (default: this file's tables) saved by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = (families or FAMILIES)[name]
    tok = build_tokenizer()
    kwargs = {**(small or SMALL), **extra}
    if model_type == "phi3":
        kwargs.pop("head_dim")
    config = AutoConfig.for_model(model_type, **kwargs)
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def hf_greedy(path, prompts, n):
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out.append(hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_hf_generate(name, tmp_path):
    path = save(name, tmp_path / name)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 90)]
    ref = hf_greedy(path, prompts, 16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(path), kv_cache_bytes=8 << 20, block_size=8))
    if FAMILIES[name][1].get("sliding_window"):
        assert WINDOW in engine.loaded.spec.layer_windows
    got = [list(o.token_ids) for o in engine.generate(prompts, params)]
    assert got == ref, f"{name}: differs from transformers"
    # prefix-cache hits: the same prompts again (their full blocks are cached)
    hits = engine.generate(prompts, params)
    # the long prompts' cached blocks reach past the window: their remaining tokens attend across it
    assert min(o.num_cached_tokens for o in hits[1:]) > WINDOW
    assert [list(o.token_ids) for o in hits] == ref, f"{name}: prefix-cache hits changed the tokens"
    if name in CHUNKING_CHANGES_ROPE:
        return
    # chunked prefill: at most 16 prompt tokens of a sequence per step
    chunked = Engine(EngineConfig(model=str(path), kv_cache_bytes=8 << 20, block_size=8,
                                  long_prefill_token_threshold=16, enable_prefix_caching=False))
    assert [list(o.token_ids) for o in chunked.generate(prompts, params)] == ref, f"{name}: chunked prefill differs"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_logits_close_to_hf(name, tmp_path):
    """Next-token logits at every position of a prompt longer than the window, through the real
    loader and runner (the CPU kernels on), within 1e-4 of transformers' eager float32 forward
    (both sum in different orders: differences seen are ~1e-5)."""
    from transformers import AutoModelForCausalLM

    from engine_workers.model.execution.runner import ModelRunner
    from engine_workers.model.loading.loader import load_model

    path = save(name, tmp_path / name)
    prompt = random.Random(3).sample(range(3, 512), 70)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    loaded = load_model(str(path), torch.float32, torch.device("cpu"), max_len=256)
    runner = ModelRunner(loaded, num_blocks=16, block_size=8, device=torch.device("cpu"), dtype=torch.float32)
    got = runner.execute(ModelInput((Chunk(prompt, 0, list(range(9)), True),), every_row=True)).logits
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
