"""CUDA: the engine runs in bf16 on the GPU with the same scheduling code, and greedy output
matches HF generate() run in fp32 on the same GPU for most tokens (bf16 rounding can flip late
near-ties, so the first tokens are compared exactly). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from bus.messages import SamplingParams
from engine_workers.config import EngineConfig
from engine_workers.engine import Engine

pytestmark = pytest.mark.gpu


def test_cuda_fp32_matches_hf_and_bf16_runs(tiny_model_dir):
    from transformers import AutoModelForCausalLM, GenerationConfig

    prompts = [[5, 6, 7, 8], list(range(3, 120)), [42] * 33]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fp32 = Engine(EngineConfig(model=tiny_model_dir, device="cuda", dtype="float32", kv_cache_bytes=16 << 20))
    assert fp32.device.type == "cuda"
    got = [list(r.token_ids) for r in fp32.generate(prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    for p, tokens in zip(prompts, got):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, len(p):].tolist()
        assert tokens == ref

    bf16 = Engine(EngineConfig(model=tiny_model_dir, device="cuda", kv_cache_bytes=16 << 20))
    assert bf16.dtype == torch.bfloat16
    out = bf16.generate(prompts, params)
    assert [len(r.token_ids) for r in out] == [24, 24, 24]
    assert all(r.token_ids[:4] == tuple(g[:4]) for r, g in zip(out, got))
    assert bf16.kv.num_free_blocks == bf16.kv.num_blocks
