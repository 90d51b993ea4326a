"""An adapter made with peft on the default model (SmolLM2-135M-Instruct: 9 query heads over 3
KV heads of 64): greedy tokens equal transformers + peft ``generate()`` token for token, with the
float32 engine (the suite's default level) and, on an AMX host, with ``--dtype auto``'s bf16
linears on AMX tiles and the adapter in bf16 beside them (engine_workers/model/lora/tiles.py)."""

from __future__ import annotations

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.kernels import cpu_kernels
from engine_workers.kernels import isa as isa_levels
from lockgate_types import SamplingParams
from tests.engine_workers.lora.adapters import hf_with_adapter, make_adapter

LEVELS = [None] + (["amx"] if isa_levels.host_isa() == "amx" else [])  # None: the suite's level (float32)


@pytest.fixture(params=LEVELS, ids=lambda lv: lv or "default")
def level(request):
    if request.param is not None:
        assert cpu_kernels.use_isa(request.param) == request.param
    try:
        yield request.param
    finally:
        cpu_kernels.use_isa(None)


def test_greedy_matches_peft_on_smollm2(default_model_dir, tmp_path, level):
    from transformers import AutoTokenizer, GenerationConfig

    adapter = make_adapter(default_model_dir, tmp_path / "a",
                           ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                           r=8, alpha=16, seed=5, b_scale=0.05)
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
    ids = list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"])
    n = 24
    hf = hf_with_adapter(default_model_dir, adapter)
    base_hf = hf_with_adapter(default_model_dir, None)
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    outs = []
    for model in (hf, base_hf):
        model.generation_config.eos_token_id = None
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 generation_config=cfg)
        outs.append(out[0, len(ids):].tolist())
    want, base_want = outs
    assert want != base_want  # the adapter changes the answer
    engine = Engine(EngineConfig(model=default_model_dir, kv_cache_bytes=64 << 20, enable_lora=True,
                                 lora_modules=(("a", str(adapter)),)))
    assert engine.lora is not None
    if level == "amx":  # the bf16 base on the tiles and the adapter beside it there
        assert all(lin.tiles is not None for lin in engine.lora.layers.values())
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    got = engine.generate([ids, ids], params, loras=["a", None])
    assert list(got[0].token_ids) == want
    assert list(got[1].token_ids) == base_want
