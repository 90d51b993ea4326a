"""Embedding requests in the engine (``SamplingParams.pooling``): the prefill ends the request with
the last prompt row's (``"last"``) or the mean of every prompt row's (``"mean"``) L2-normalised
final hidden state, checked against transformers' own forward on the same tiny checkpoint; batched
with generating requests, which are unaffected."""

from __future__ import annotations

import pytest
import torch

from bus import SamplingParams as WireParams
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.execution.runner import kv_block_bytes
from lockgate_types import SamplingParams


def reference(model_dir: str, ids: list[int], pooling: str = "last") -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        out = m(torch.tensor([ids]), output_hidden_states=True)
    states = out.hidden_states[-1][0]  # after the final norm, [T, hidden]
    return torch.nn.functional.normalize(states[-1] if pooling == "last" else states.mean(0), dim=-1)


def run(engine: Engine) -> dict:
    outs: dict = {}
    for _ in range(200):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        if not engine.has_unfinished():
            return outs
    raise AssertionError("the engine did not finish")


def test_last_token_pooling_matches_transformers_and_leaves_generation_alone(tiny_model_dir: str) -> None:
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20, max_num_seqs=8))
    a, b = [5, 9, 33, 41, 7, 100], list(range(3, 60))  # b spans several KV blocks
    gen = SamplingParams(max_tokens=6, temperature=0)
    alone = engine.generate([[1, 2, 3]], gen)[0].token_ids
    engine.add_request("e1", a, SamplingParams(max_tokens=1, pooling="last"))
    engine.add_request("g", [1, 2, 3], gen)
    engine.add_request("e2", b, SamplingParams(max_tokens=1, pooling="last"))
    outs = run(engine)
    for rid, ids in (("e1", a), ("e2", b)):
        (final,) = outs[rid]
        assert final.finished and final.finish_reason == "stop" and final.num_output_tokens == 0
        assert final.token_ids == () and final.num_prompt_tokens == len(ids)
        vec = torch.tensor(final.embedding)
        assert vec.shape == (engine.runner.spec.hidden_size,)
        assert torch.allclose(vec, reference(tiny_model_dir, ids), atol=1e-4), rid
    assert tuple(t for o in outs["g"] for t in o.token_ids) == alone
    # the same prompt again: its prefix blocks are cached, the vector is the same
    engine.add_request("e3", a, SamplingParams(max_tokens=1, pooling="last"))
    assert torch.allclose(torch.tensor(run(engine)["e3"][-1].embedding), torch.tensor(outs["e1"][0].embedding),
                          atol=1e-5)


def test_pooling_is_checked():
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="max")
    with pytest.raises(ValueError, match="pooling"):
        WireParams(pooling="cls")
    assert WireParams(pooling="mean").pooling == SamplingParams(pooling="mean").pooling == "mean"


def test_mean_pooling_sums_every_chunk_and_skips_the_prefix_cache(tiny_model_dir: str) -> None:
    """Mean pooling over chunked prefill: with at most 16 prompt tokens per step a 57-token prompt
    takes four steps and the mean still equals transformers' over all its rows. The same prompt
    again finds its blocks cached (a last-pooled twin hits them) but the mean-pooled request
    computes every row (no cached tokens) and gives the same vector; generation alongside is as alone."""
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20, max_num_seqs=8,
                                 long_prefill_token_threshold=16))
    a, b = [5, 9, 33, 41, 7, 100], list(range(3, 60))
    gen = SamplingParams(max_tokens=6, temperature=0)
    alone = engine.generate([[1, 2, 3]], gen)[0].token_ids
    engine.add_request("m1", b, SamplingParams(max_tokens=1, pooling="mean"))
    engine.add_request("g", [1, 2, 3], gen)
    engine.add_request("m2", a, SamplingParams(max_tokens=1, pooling="mean"))
    outs = run(engine)
    assert engine.stats.steps >= 4  # b was prefilled in chunks
    for rid, ids in (("m1", b), ("m2", a)):
        (final,) = outs[rid]
        assert final.finished and final.finish_reason == "stop" and final.token_ids == ()
        vec = torch.tensor(final.embedding)
        assert torch.allclose(vec, reference(tiny_model_dir, ids, "mean"), atol=1e-4), rid
        assert abs(float(vec.norm()) - 1.0) < 1e-5
        assert not torch.allclose(vec, reference(tiny_model_dir, ids, "last"), atol=1e-2)  # a different pooling
    assert tuple(t for o in outs["g"] for t in o.token_ids) == alone
    engine.add_request("last", b, SamplingParams(max_tokens=1, pooling="last"))
    engine.add_request("again", b, SamplingParams(max_tokens=1, pooling="mean"))
    again = run(engine)
    assert again["last"][0].num_cached_tokens > 0  # m1's blocks were registered: a would-be hit
    assert again["again"][0].num_cached_tokens == 0
    assert torch.allclose(torch.tensor(again["again"][0].embedding), torch.tensor(outs["m1"][0].embedding), atol=1e-5)


def test_a_preempted_mean_pooled_request_restarts_its_sum(tiny_model_dir: str) -> None:
    """Preempted by recompute mid-prefill (KV for only one of two long prompts), a mean-pooled
    request recomputes from row 0 and its vector is still the mean over its rows, once each."""
    block = kv_block_bytes(Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20)).runner.spec, 16,
                           torch.float32)
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=6 * block, max_num_seqs=4,
                                 long_prefill_token_threshold=16))  # 6 blocks: one 57-token prompt's 4 fit, not two
    b, c = list(range(3, 60)), list(range(100, 157))
    engine.add_request("x", b, SamplingParams(max_tokens=1, pooling="mean"))
    engine.add_request("y", c, SamplingParams(max_tokens=1, pooling="mean"))
    outs = run(engine)
    assert engine.stats.preemptions >= 1
    for rid, ids in (("x", b), ("y", c)):
        assert torch.allclose(torch.tensor(outs[rid][-1].embedding), reference(tiny_model_dir, ids, "mean"),
                              atol=1e-4), rid


def test_an_embedding_request_is_prefill_only_and_holds_no_decode_slot(tiny_model_dir: str) -> None:
    """With ``max_num_seqs=1`` (one running slot), an embedding request ends in the step that
    prefills it: it is never scheduled for a decode step, its KV blocks go back to the pool (or to
    the prefix cache) at once, and a generating request queued behind it gets the slot next step."""
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20, max_num_seqs=1,
                                 enable_prefix_caching=False))
    free = engine.kv.num_free_blocks
    engine.add_request("e", list(range(3, 60)), SamplingParams(max_tokens=1, pooling="last"))
    engine.add_request("g", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    first = engine.step()
    assert [(o.request_id, o.finished, o.token_ids) for o in first] == [("e", True, ())]
    assert engine.scheduler.running == [] and engine.kv.num_free_blocks == free
    second = engine.step()  # the slot is free: the generating request is prefilled (and samples) now
    assert [o.request_id for o in second] == ["g"] and len(second[0].token_ids) == 1
