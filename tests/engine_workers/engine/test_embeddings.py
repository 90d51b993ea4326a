"""Embedding requests in the engine (``SamplingParams.pooling="last"``): the prefill ends the
request with the last prompt row's L2-normalised final hidden state, checked against transformers'
own forward on the same tiny checkpoint; batched with generating requests, which are unaffected."""

from __future__ import annotations

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.engine.params import SamplingParams


def reference(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        out = m(torch.tensor([ids]), output_hidden_states=True)
    return torch.nn.functional.normalize(out.hidden_states[-1][0, -1], dim=-1)  # after the final norm


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
        SamplingParams(pooling="mean")


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
