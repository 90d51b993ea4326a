"""LoRA adapters made with peft on the tiny model: the engine's logits and greedy tokens equal
transformers + peft (unmerged) for every target lockgate adapts, rsLoRA and per-module alphas; a
batch mixing the base model and two adapters equals each request run alone; the prefix cache
shares no KV across adapters."""

from __future__ import annotations

import random

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.execution.batch import Chunk, ModelInput
from lockgate_types import SamplingParams
from tests.engine_workers.lora.adapters import hf_with_adapter, make_adapter

CASES = {
    "q": dict(targets=["q_proj"]),
    "k": dict(targets=["k_proj"]),
    "v": dict(targets=["v_proj"]),
    "o": dict(targets=["o_proj"]),
    "gate": dict(targets=["gate_proj"]),
    "up": dict(targets=["up_proj"]),
    "down": dict(targets=["down_proj"]),
    "all_rslora": dict(targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                       r=8, alpha=4.0, rslora=True),
    "patterns": dict(targets=["q_proj", "v_proj", "down_proj"], r=4, rank_pattern={"v_proj": 2},
                     alpha_pattern={"down_proj": 3.0}),
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(tiny_model_dir, root / name, seed=i, **kw) for i, (name, kw) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def engine(tiny_model_dir, adapters):
    return Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20, max_num_batched_tokens=256,
                               enable_lora=True, lora_modules=tuple((n, str(p)) for n, p in adapters.items()),
                               max_loras=3, max_cpu_loras=4))


def prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def engine_logits(engine: Engine, ids: list[int], lora: str | None) -> torch.Tensor:
    blocks = list(range((len(ids) + engine.config.block_size - 1) // engine.config.block_size))
    batch = ModelInput((Chunk(ids, 0, blocks, True),), every_row=True, loras=(lora,))
    return engine.runner.execute(batch).logits


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_peft(engine, tiny_model_dir, adapters, case):
    ids = prompt(1, 40)
    with torch.inference_mode():
        ref = hf_with_adapter(tiny_model_dir, adapters[case])(torch.tensor([ids])).logits[0]
        merged = hf_with_adapter(tiny_model_dir, adapters[case], merged=True)(torch.tensor([ids])).logits[0]
        base = hf_with_adapter(tiny_model_dir, None)(torch.tensor([ids])).logits[0]
    got = engine_logits(engine, ids, case)
    scale = max(1.0, ref.abs().max().item())
    assert (ref - base).abs().max().item() > 1e-2 * scale, "the adapter must change the logits for the test to mean anything"
    assert (got - ref).abs().max().item() < 1e-4 * scale
    assert (got - merged).abs().max().item() < 1e-4 * scale  # and PEFT's merged weights
    assert (engine_logits(engine, ids, None) - base).abs().max().item() < 1e-4 * scale  # slots left no trace


def test_greedy_matches_peft_generate(engine, tiny_model_dir, adapters):
    from transformers import GenerationConfig

    ids, n = prompt(2, 25), 24
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for case in ("all_rslora", "q"):
        hf = hf_with_adapter(tiny_model_dir, adapters[case])
        hf.generation_config.eos_token_id = None
        cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            out = hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              generation_config=cfg)
        want = out[0, len(ids):].tolist()
        assert list(engine.generate([ids], params, loras=[case])[0].token_ids) == want, case


def test_mixed_batch_equals_each_alone(engine):
    """Base, two adapters, interleaved so one adapter's rows are not contiguous (the gathered path)."""
    loras = [None, "all_rslora", "gate", "all_rslora", None, "gate"]
    prompts = [prompt(10 + i, 5 + 7 * i) for i in range(len(loras))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # one prefill step over all six: the batch really mixes three kinds of rows
    together = [list(d.token_ids) for d in engine.generate(prompts, params, loras=loras, cache_salt="mixed")]
    alone = [list(engine.generate([p], params, loras=[lo], cache_salt=f"alone-{i}")[0].token_ids)
             for i, (p, lo) in enumerate(zip(prompts, loras))]
    assert together == alone
    assert len({tuple(t) for t in together[:3]}) == 3  # base and the two adapters disagree


def test_more_adapters_than_slots_wait_their_turn(tiny_model_dir, adapters):
    """max_loras=1: requests for two adapters and the base never share a batch across adapters,
    and each still gets its own adapter's output."""
    one = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20, enable_lora=True, max_loras=1,
                              lora_modules=(("q", str(adapters["q"])), ("down", str(adapters["down"])))))
    loras = ["q", "down", None, "q"]
    prompts = [prompt(30 + i, 9) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    together = [list(d.token_ids) for d in one.generate(prompts, params, loras=loras)]
    alone = [list(one.generate([p], params, loras=[lo], cache_salt="x")[0].token_ids) for p, lo in zip(prompts, loras)]
    assert together == alone


def test_prefix_cache_is_per_adapter(engine):
    ids = prompt(40, 64)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = engine.generate([ids], params, loras=["o"])[0]
    assert engine.generate([ids], params, loras=["o"])[0].num_cached_tokens >= 48  # same adapter: shared
    for other in (None, "v"):
        assert engine.generate([ids], params, loras=[other])[0].num_cached_tokens == 0, other
    assert first.num_cached_tokens == 0


def test_resume_with_an_adapter_continues_exactly(engine):
    """What a worker does after another died mid-request (engine_workers/worker/offsets/resume.py):
    the published tokens as ``resume_token_ids``, the same adapter; the rest equals the
    uninterrupted run's."""
    ids = prompt(50, 20)
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
    full = list(engine.generate([ids], params, loras=["all_rslora"], cache_salt="resume")[0].token_ids)
    engine.add_request("resumed", ids, params, lora="all_rslora", resume_token_ids=full[:6])
    rest: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            rest.extend(out.token_ids)
    assert full[:6] + rest == full
    base = list(engine.generate([ids], params)[0].token_ids)
    assert base != full  # the adapter matters for this request, so the check above means something


def test_adapters_load_and_unload_at_run_time(tiny_model_dir, adapters):
    from engine_workers.model.lora.peft_config import LoraError

    eng = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20, enable_lora=True, max_loras=2))
    ids = prompt(60, 40)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = list(eng.generate([ids], params)[0].token_ids)
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        eng.add_request("x", ids, params, lora="late")
    eng.add_lora("late", str(adapters["all_rslora"]))
    with_late = eng.generate([ids], params, loras=["late"])[0]
    assert list(with_late.token_ids) != want and with_late.num_cached_tokens == 0
    with pytest.raises(LoraError, match="already loaded"):
        eng.add_lora("late", str(adapters["q"]))
    with pytest.raises(LoraError, match="is not a folder"):
        eng.add_lora("broken", str(adapters["q"] / "nowhere"))
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        eng.add_request("z", ids, params, lora="broken")  # a failed load serves nothing
    eng.add_request("busy", ids, params, lora="late")
    with pytest.raises(ValueError, match="in use by 1 request"):
        eng.remove_lora("late")
    while eng.has_unfinished():
        eng.step()
    eng.remove_lora("late")
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        eng.add_request("y", ids, params, lora="late")
    # added again under the same name: another adapter now, and none of the old one's KV is reused
    eng.add_lora("late", str(adapters["q"]))
    again = eng.generate([ids], params, loras=["late"])[0]
    assert again.num_cached_tokens == 0 and list(again.token_ids) != list(with_late.token_ids)
    assert list(eng.generate([ids], params)[0].token_ids) == want  # the base model is as it was
