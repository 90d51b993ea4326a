"""The engine's greedy output equals HF ``generate()`` token for token (tiny model and SmolLM2),
with everything submitted together so continuous batching, chunked prefill, prefix caching and
preemption are all in play."""

from __future__ import annotations

import random

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from lockgate_types import SamplingParams


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    """HF generate() on one request, no padding, EOS disabled (the engine runs with ignore_eos)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    # generate() fills unset fields from the model's own generation config: clear EOS there too.
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), generation_config=cfg)
    return out[0, len(prompt_ids):].tolist()


def workload(vocab: int, n: int, seed: int, max_prompt: int = 300, max_new: int = 100) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lengths = [1, max_prompt] + [rng.randint(1, max_prompt) for _ in range(n - 2)]
    news = [max_new, 1] + [rng.randint(1, max_new) for _ in range(n - 2)]
    return [([rng.randrange(3, vocab) for _ in range(p)], m) for p, m in zip(lengths, news)]


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def run_together(engine: Engine, reqs: list[tuple[list[int], int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    done = engine.generate([p for p, _ in reqs], params)
    return [list(d.token_ids) for d in done]


def test_greedy_matches_hf_generate_tiny(tiny_model_dir, hf_tiny):
    reqs = workload(hf_tiny.config.vocab_size, 16, seed=1)
    engine = Engine(EngineConfig(model=tiny_model_dir, max_num_batched_tokens=256, max_num_seqs=16, kv_cache_bytes=8 << 20))
    got = run_together(engine, reqs)
    for i, ((prompt, m), tokens) in enumerate(zip(reqs, got)):
        assert len(tokens) == m
        assert tokens == hf_greedy(hf_tiny, prompt, m), f"request {i} (prompt {len(prompt)} tokens, {m} new) differs"
    # Continuous batching really batched: fewer steps than the sum of the requests' lengths.
    assert engine.stats.steps < sum(m for _, m in reqs)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_preemption_keeps_outputs_identical(tiny_model_dir, hf_tiny):
    reqs = workload(hf_tiny.config.vocab_size, 16, seed=2, max_prompt=120, max_new=60)
    # 40 blocks x 16 tokens = 640 tokens of KV: far less than the batch's ~2,000 tokens.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K,V) * block * kv_heads * head_dim * fp32
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=40 * block_bytes, max_num_seqs=16, max_num_batched_tokens=128))
    assert engine.kv.num_blocks == 40
    got = run_together(engine, reqs)
    assert engine.stats.preemptions > 0
    for (prompt, m), tokens in zip(reqs, got):
        assert tokens == hf_greedy(hf_tiny, prompt, m)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_cache_computes_only_the_suffix(tiny_model_dir, hf_tiny):
    rng = random.Random(3)
    vocab = hf_tiny.config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(200)]
    first = shared + [rng.randrange(3, vocab) for _ in range(10)]
    second = shared + [rng.randrange(3, vocab) for _ in range(7)]
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20))
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.generate([first], p)
    before = engine.stats.computed_tokens
    (out,) = engine.generate([second], p)
    computed = engine.stats.computed_tokens - before
    cached = (200 // 16) * 16  # full blocks of the shared prefix
    assert out.num_cached_tokens == cached
    # The suffix of the prompt, then one token per decode step after the first sampled token.
    assert computed == len(second) - cached + (5 - 1)
    assert list(out.token_ids) == hf_greedy(hf_tiny, second, 5)
    assert engine.kv.stats.hits >= cached


def test_greedy_matches_hf_generate_smollm2(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    texts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Colour of the sky?"}],
        [{"role": "user", "content": "List three prime numbers and explain why each is prime, briefly."}],
    ]
    prompts = [list(tok.apply_chat_template(t, tokenize=True, add_generation_prompt=True)["input_ids"]) for t in texts]
    news = [24, 16, 8, 32]
    engine = Engine(EngineConfig(model=default_model_dir, kv_cache_bytes=64 << 20))
    got = run_together(engine, list(zip(prompts, news)))
    for prompt, m, tokens in zip(prompts, news, got):
        assert tokens == hf_greedy(hf, prompt, m)
