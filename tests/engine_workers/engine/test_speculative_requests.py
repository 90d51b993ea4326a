"""Speculative decoding and the request features that could go wrong under it: structured output
(the grammar matcher walks the proposals and is rolled back), n > 1 (the edge's seeds base + i,
in one batch), with the n-gram proposer and with a draft model."""

from __future__ import annotations

import json

import pytest

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.engine.guided import Guide
from engine_workers.engine.speculative import SpeculativeConfig
from lockgate_types import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["ab", "cd", "ef"]},
                                                    "maxItems": 6}},
          "required": ["name", "tags"], "additionalProperties": False}
NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> Engine:
    return Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20))


@pytest.fixture(scope="module", params=["ngram", "draft"])
def spec(request, tiny_model_dir) -> Engine:
    cfg = NGRAM if request.param == "ngram" else SpeculativeConfig(4, method="draft_model", model=tiny_model_dir)
    return Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20, speculative_config=cfg))


def test_guided_requests_speculate_and_keep_plain_decodings_tokens(plain, spec):
    """JSON-schema, regex and choice requests, greedy and sampled, mixed with free ones: tokens
    and texts equal plain decoding's, every JSON valid, proposals of guided requests verified."""
    schema = json.dumps(SCHEMA)
    prompt = spec.encode_prompt('{"name": "ab", "tags": ["ab", "cd", "ab", "cd", "ab"]} again: ')
    params = [SamplingParams(max_tokens=120, temperature=0, guided_json=schema),
              SamplingParams(max_tokens=120, temperature=0.7, seed=4, guided_json=schema),
              SamplingParams(max_tokens=120, temperature=1.0, top_k=30, seed=9, guided_json=schema),
              SamplingParams(max_tokens=40, temperature=0.5, seed=2, guided_regex=r"(ab|cd){3,8}"),
              SamplingParams(max_tokens=40, temperature=0.9, seed=1, guided_choice=("ab cd ab", "ef ef")),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)]
    want = [plain.generate([prompt], [p])[0] for p in params]
    before = spec.stats.spec_num_accepted_tokens
    got = spec.generate([prompt] * len(params), params)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason, i
    for g in got[:3]:
        obj = json.loads(g.text)
        assert set(obj) == {"name", "tags"}
    assert spec._num_guided == 0
    # the guided requests alone: speculation reached them
    before = spec.stats.spec_num_accepted_tokens
    again = spec.generate([prompt] * 3, params[:3])
    assert [g.token_ids for g in again] == [w.token_ids for w in want[:3]]
    assert spec.stats.spec_num_accepted_tokens > before


def test_the_grammar_walk_leaves_the_matcher_as_it_was(spec):
    """``allowed_prefix`` stops at the first refused token and rolls the matcher back."""
    compiled = spec.grammars().compile(SamplingParams(guided_regex=r"ab(cd)+").guided)
    tok = spec.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "d", "c", "d")]
    assert all(isinstance(i, int) and i >= 0 for i in ids)
    g = Guide(compiled)
    assert g.allowed_prefix(ids) == 6
    assert g.allowed_prefix([ids[1]]) == 0  # "b" cannot start
    assert g.allowed_prefix(ids[:2] + [ids[0]]) == 2
    assert g.accept(ids[0]) and g.accept(ids[1])  # the matcher is still at the start


def test_n_choices_seeded_base_plus_i_in_one_batch(plain, spec):
    """n > 1 is n requests with seeds base + i (the edge fans them out): in one batch under
    speculation each equals its plain decoding."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 3
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True)
              for i in range(4)]
    want = [plain.generate([prompt], [p])[0].token_ids for p in params]
    got = [c.token_ids for c in spec.generate([prompt] * 4, params)]
    assert got == want and len(set(got)) > 1
