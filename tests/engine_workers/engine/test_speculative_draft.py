"""Speculative decoding with a draft model: configuration, the tokenizer check, the draft's own
K/V and its rollback, and the claim: with a draft (random, perturbed, or the target itself) every
request's tokens are those of plain decoding, greedy and seeded, alone and in mixed batches."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.engine.draft import DraftItem
from engine_workers.engine.sequence import Sequence
from engine_workers.engine.speculative import SpeculativeConfig
from lockgate_types import SamplingParams
from tokenization.model_store import ModelError

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4,
    [40, 41, 42, 43] * 6 + [40, 41],
    [100 + i for i in range(20)] * 2,
    [459, 11, 356, 398, 89, 356, 398, 380, 89, 356],
    [3, 90, 17, 250, 61],
]
MIXED = [
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.1, top_p=0.9, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=5),
    SamplingParams(max_tokens=40, temperature=0.7, top_k=50, top_p=0.8, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=33, temperature=0.8, top_k=5, top_p=0.95, min_p=0.05, seed=6, ignore_eos=True),
]


def _draft_config(path: str, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.from_json(f'{{"method": "draft_model", "model": "{path}", "num_speculative_tokens": {k}}}')


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory) -> str:
    """A smaller random model with the tiny target's tokenizer (1 layer, other seed)."""
    from devtools.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), num_layers=1, hidden_size=32, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=1))


@pytest.fixture(scope="module")
def perturbed_draft_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The target with noise on one layer's MLP: agrees with it often, not always (partial
    acceptance, so the draft's K/V are rolled back mid-proposal)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("tiny-perturbed")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    (weights,) = Path(out).glob("*.safetensors")
    state = load_file(str(weights))
    gen = torch.Generator().manual_seed(0)
    name = "model.layers.1.mlp.down_proj.weight"
    state[name] = state[name] + 0.04 * torch.randn(state[name].shape, generator=gen)
    save_file(state, str(weights), metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> Engine:
    return Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=1 << 22))


def _engine(target: str, draft: str, k: int = 4) -> Engine:
    return Engine(EngineConfig(model=target, kv_cache_bytes=1 << 22, speculative_config=_draft_config(draft, k)))


def _check(plain: Engine, spec: Engine, params: list[SamplingParams], prompts=PROMPTS) -> None:
    """Each request alone on the plain engine vs all together, then each alone, on the speculative
    one; every token, text and finish reason equal."""
    want = [plain.generate([p], [q])[0] for p, q in zip(prompts, params)]
    together = spec.generate(prompts, params)
    alone = [spec.generate([p], [q])[0] for p, q in zip(prompts, params)]
    for i, (w, t, a) in enumerate(zip(want, together, alone)):
        assert t.token_ids == w.token_ids and t.finish_reason == w.finish_reason, f"request {i} in a batch"
        assert t.text == w.text
        assert a.token_ids == w.token_ids, f"request {i} alone"
    # every finished request gave its draft state back
    assert spec.draft is not None and spec.draft.num_tracked() == 0
    assert spec.draft.kv.num_free_blocks == spec.draft.kv.num_blocks


def _rate(engine: Engine) -> float:
    st = engine.stats
    return st.spec_num_accepted_tokens / max(st.spec_num_draft_tokens, 1)


# -- configuration ------------------------------------------------------------------------------


def test_config_takes_vllms_draft_model_keys():
    c = SpeculativeConfig.from_json('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 5}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/m", 5)
    # vLLM: a model without a method is a draft model
    assert SpeculativeConfig.from_json('{"model": "/m", "num_speculative_tokens": 2}').method == "draft_model"


@pytest.mark.parametrize("text, named", [
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs \"model\""),
    ('{"method": "ngram", "model": "/m", "num_speculative_tokens": 2}', "takes no \"model\""),
    ('{"model": 3, "num_speculative_tokens": 2}', "model must be a string"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not implemented"),
    ('{"method": "mtp", "model": "/m", "num_speculative_tokens": 2}', "takes no \"model\""),
])
def test_bad_draft_config_is_an_error_naming_it(text, named):
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.from_json(text)


def test_a_draft_with_another_tokenizer_is_refused(tiny_model_dir, random_draft_dir, tmp_path):
    from devtools.tiny_model import build_tokenizer

    other = tmp_path / "other-tokenizer"
    shutil.copytree(random_draft_dir, other)
    for f in other.glob("tokenizer*"):
        f.unlink()
    build_tokenizer(vocab_size=400).save_pretrained(other)
    with pytest.raises(ModelError, match="different tokenizer"):
        _engine(tiny_model_dir, str(other))
    with pytest.raises(ValueError, match="cannot|lack|not"):
        _engine(tiny_model_dir, str(tmp_path / "missing"))


# -- the claim ------------------------------------------------------------------------------------


def test_random_draft_tokens_equal_plain_decoding(plain, tiny_model_dir, random_draft_dir):
    """A random draft is rarely right: the target's verification keeps the tokens exact anyway."""
    spec = _engine(tiny_model_dir, random_draft_dir)
    _check(plain, spec, MIXED)
    assert spec.stats.spec_num_drafts > 0 and spec.draft is not None and spec.draft.forwards > 0


def test_perturbed_draft_partial_acceptance_is_exact(plain, tiny_model_dir, perturbed_draft_dir):
    spec = _engine(tiny_model_dir, perturbed_draft_dir)
    _check(plain, spec, MIXED)
    st = spec.stats
    # drafts were both partly accepted and partly rolled back
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert _rate(spec) > 0.3


def test_the_target_as_its_own_draft_is_accepted_throughout(plain, tiny_model_dir):
    """The draft draws each position with the request's own (seed, position) draw: the target as
    its own draft proposes exactly the target's tokens, greedy and sampled."""
    spec = _engine(tiny_model_dir, tiny_model_dir)
    _check(plain, spec, MIXED)
    assert spec.stats.spec_num_draft_tokens > 50 and _rate(spec) > 0.95


def test_stops_logprobs_penalties_and_max_tokens_with_a_draft(plain, tiny_model_dir, perturbed_draft_dir):
    free = plain.generate([PROMPTS[3]], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)])[0]
    params = [
        SamplingParams(max_tokens=40, temperature=0.3, seed=8, repetition_penalty=1.2, frequency_penalty=0.1),
        SamplingParams(max_tokens=40, temperature=0, min_tokens=10, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(free.token_ids[12],), ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(free.text[-6:-2],)),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[2], PROMPTS[3]]
    spec = _engine(tiny_model_dir, perturbed_draft_dir)
    _check(plain, spec, params, prompts)
    outs = []
    lp = SamplingParams(max_tokens=30, temperature=0.5, seed=2, logprobs=3, ignore_eos=True)
    for e in (plain, spec):
        e.add_request("lp", PROMPTS[3], lp)
        got = []
        while e.has_unfinished():
            got += [x for o in e.step() for x in (o.logprobs or ())]
        outs.append(got)
    assert outs[0] == outs[1] and len(outs[0]) == 30


# -- the draft's K/V: rolled back to what the request's tokens agree with -------------------------


def test_rolled_back_draft_proposes_what_a_fresh_draft_proposes(tiny_model_dir, perturbed_draft_dir):
    """After a round whose proposals were partly wrong, the draft's next proposal (from its
    rolled-back K/V plus a catch-up chunk) equals a fresh draft's (a prefill of every token)."""
    a = _engine(tiny_model_dir, perturbed_draft_dir).draft
    assert a is not None
    params = SamplingParams(temperature=0)
    seq = Sequence("s", list(PROMPTS[3]), params)
    (first,) = a.propose([DraftItem(seq, 4)])
    assert len(first) == 4
    # the verification accepts two proposals, then the target's token differs from the third
    seq.output_token_ids += first[:2] + [(first[2] + 1) % 500]
    assert a.num_valid(seq) == len(PROMPTS[3]) + 2
    assert len(a.kv.block_ids("s")) == a.kv.blocks_needed(len(PROMPTS[3]) + 2)
    (again,) = a.propose([DraftItem(seq, 4)])
    fresh = _engine(tiny_model_dir, perturbed_draft_dir).draft
    assert fresh is not None
    (want,) = fresh.propose([DraftItem(Sequence("s", list(seq.all_token_ids), params), 4)])
    assert again == want
    # a round whose proposals were never verified: the next one recomputes the last row only
    (same,) = a.propose([DraftItem(seq, 4)])
    assert same == again
    a.forget("s")
    assert a.num_tracked() == 0 and a.kv.num_free_blocks == a.kv.num_blocks


def test_a_full_draft_cache_drops_speculation_not_requests(plain, tiny_model_dir, random_draft_dir):
    """Draft K/V for only a few requests: the rest decode plainly, tokens still exact."""
    cfg = EngineConfig(model=tiny_model_dir, kv_cache_bytes=1 << 22, speculative_config=_draft_config(random_draft_dir))
    spec = Engine(cfg)
    assert spec.draft is not None
    # shrink the draft's pool to 4 blocks of 16 tokens: room for one prompt at a time
    from kv_store import KVCacheManager

    spec.draft.kv = KVCacheManager(4, cfg.block_size, enable_prefix_caching=False)
    _check(plain, spec, MIXED)
