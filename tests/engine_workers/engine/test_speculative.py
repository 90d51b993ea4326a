"""Speculative decoding (n-gram): configuration, the proposer, the scheduler's share, KV rollback,
and the claim itself: with speculation on, every request's tokens are those of plain decoding."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.engine.ngram import NgramProposer
from engine_workers.engine.scheduler import Scheduler, SchedulerConfig
from engine_workers.engine.sequence import Sequence
from engine_workers.engine.speculative import MAX_BACKOFF_STEPS, SpecBackoff, SpeculativeConfig, batch_limit
from engine_workers.model.execution.batch import Chunk, ModelInput
from kv_store import KVCacheManager
from lockgate.options import add_engine_args, engine_config_from_args
from lockgate_types import SamplingParams

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)

# -- configuration ------------------------------------------------------------------------------


def test_config_follows_vllms_keys_and_defaults():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 3, 4, 4)
    c = SpeculativeConfig.from_json('{"num_speculative_tokens": 2, "prompt_lookup_min": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = SpeculativeConfig.from_json('{"num_speculative_tokens": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    for off in ("", "  ", "null", "{}"):
        assert SpeculativeConfig.from_json(off) is None


@pytest.mark.parametrize("text, named", [
    ("{", "not valid JSON"),
    ("[4]", "JSON object"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_max": -1}', "prompt_lookup_max"),
    ('{"num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "'eagle3' is not implemented"),
    ('{"method": "bogus", "num_speculative_tokens": 2}', "unknown method 'bogus'"),
    ('{"method": "ngram", "model": "x", "num_speculative_tokens": 2}', "takes no \"model\""),
    ('{"num_speculative_tokens": 2, "prompt_lookup_maxx": 3}', "unknown key 'prompt_lookup_maxx'"),
])
def test_bad_config_is_an_error_naming_the_key(text, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        SpeculativeConfig.from_json(text)


def test_flag_and_env_twin_reach_the_engine_config(monkeypatch):
    def parse(*argv):
        p = argparse.ArgumentParser()
        add_engine_args(p)
        return engine_config_from_args(p.parse_args(list(argv)))

    assert parse().speculative_config is None
    got = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}').speculative_config
    assert got == SpeculativeConfig(num_speculative_tokens=3)
    monkeypatch.setenv("LOCKGATE_SPECULATIVE_CONFIG", '{"num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert parse().speculative_config == SpeculativeConfig(2, prompt_lookup_max=3, prompt_lookup_min=3)
    with pytest.raises(SystemExit):
        parse("--speculative-config", '{"num_speculative_tokens": "four"}')
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative_config=SPEC, tensor_parallel_size=2)


# -- the proposer -------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_recent_match():
    p = NgramProposer(1, 3)
    # the 3-gram (1, 2, 3) occurred at 0 and at 5: the latest followed by k tokens is at 5
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3], 3) == [7, 8, 6]
    # the latest match (overlapping the suffix) is followed by fewer than k: an earlier one is
    two = NgramProposer(2, 2)
    assert two.propose([2, 2, 5, 6, 7, 8, 2, 2, 2], 3) == [5, 6, 7]
    assert two.propose([2, 2, 5, 2, 2, 2], 5) == [5, 2, 2, 2]  # none is: the earliest, followed by most
    assert p.propose([5, 1, 2, 3, 6, 2, 3], 2) == [6, 2]  # no 3-gram match: the 2-gram (2, 3)
    assert p.propose([4, 5, 6, 7], 3) == []  # nothing repeats
    assert p.propose([1, 2, 1], 0) == []
    assert NgramProposer(2, 2).propose([7, 1, 8, 1], 2) == []  # a 1-gram match is below the minimum
    assert p.propose([3, 3], 4) == [3]  # only what actually followed
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def test_backoff_skips_more_steps_after_each_fully_rejected_draft():
    b = SpecBackoff()
    assert b.allows(0)
    b.record(10, 0)
    assert not b.allows(12) and b.allows(13)
    b.record(13, 0)
    assert not b.allows(17) and b.allows(18)
    for _ in range(10):
        b.record(20, 0)
    assert b.allows(21 + MAX_BACKOFF_STEPS) and not b.allows(20 + MAX_BACKOFF_STEPS)
    b.record(40, 2)
    assert b.allows(41)


def test_draft_length_follows_acceptance_and_batch_size():
    b = SpecBackoff()
    assert b.limit(4) == 4
    b.record(1, 0, 4)  # nothing accepted: the next draft (after the sit-out) probes with one token
    assert b.limit(4) == 1
    b.record(9, 1, 1)  # fully accepted: double
    assert b.limit(4) == 2
    b.record(10, 2, 2)
    assert b.limit(4) == 4 and b.limit(3) == 3
    b.record(11, 1, 4)  # one of four: two next
    assert b.limit(4) == 2
    b.record(12, 3, 4)
    assert b.limit(4) == 4
    assert [batch_limit(4, n, 8) for n in (1, 2, 3, 4, 6, 8)] == [4, 4, 3, 3, 2, 1]
    assert batch_limit(1, 8, 8) == 1 and batch_limit(8, 1, 1) == 8


# -- scheduler and KV ---------------------------------------------------------------------------


def _decoding(s: Scheduler, n_prompt: int) -> tuple[Sequence, Sequence]:
    """Two sequences prefilled, each with its first token: both decoding."""
    seqs = tuple(Sequence(name, list(range(1, n_prompt + 1)), SamplingParams(temperature=0)) for name in "ab")
    for seq in seqs:
        s.add(seq)
    s.on_step_done(s.schedule())
    for seq in seqs:
        seq.output_token_ids.append(7)
    return seqs


def test_the_token_budget_counts_speculative_positions():
    kv = KVCacheManager(64, 4)
    s = Scheduler(SchedulerConfig(8, 9), kv)
    a, b = _decoding(s, 4)
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3, 4, 5, 6], [1, 2, 3]
    out = s.schedule()
    got = {i.seq.seq_id: (i.num_new_tokens, i.num_spec, i.samples) for i in out.scheduled}
    # a takes 1 + 6 of the 9; b's decode token and one proposal fill the rest
    assert got == {"a": (7, 6, True), "b": (2, 1, True)}
    assert out.num_batched_tokens == 9
    assert len(kv.block_ids("a")) == kv.blocks_needed(a.num_tokens + 6)


def test_speculation_never_preempts_and_rollback_frees_the_tail():
    kv = KVCacheManager(4, 4)
    s = Scheduler(SchedulerConfig(8, 64), kv)
    a, b = _decoding(s, 7)  # 2 blocks each: the pool is full
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert not out.preempted and {i.seq.seq_id: i.num_spec for i in out.scheduled} == {"a": 0, "b": 0}
    kv2 = KVCacheManager(8, 4)
    kv2.allocate("x", 13)
    kv2.commit_computed("x", list(range(13)), 8)  # two full blocks registered
    assert kv2.truncate("x", 9) == 1 and len(kv2.block_ids("x")) == 3
    assert kv2.truncate("x", 9) == 0
    with pytest.raises(ValueError, match="registered"):
        kv2.truncate("x", 4)


# -- logits: a verification row is the decode row of its position, bit for bit --------------------


@pytest.mark.parametrize("mode", [
    {}, {"cpu_kernels": False}, {"dtype": "bfloat16"}, {"quantization": "int8"}, {"quantization": "q4_1"},
    {"quantization": "w8a8"}, {"kv_cache_dtype": "bfloat16"},
], ids=["fp32", "no-cpu-kernels", "bf16", "int8", "q4_1", "w8a8", "bf16-kv"])
def test_verification_rows_equal_single_step_decode_logits(tiny_model_dir, mode):
    """Every CPU weight / KV mode: the claim rests on the rows being batch-invariant in each."""
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=1 << 21, **mode))
    runner = engine.runner
    prompt = [(i * 37) % 500 + 3 for i in range(29)]
    drafts = [11, 200, 31, 7]
    other = [(i * 11) % 500 + 3 for i in range(40)]
    table_a, table_b, table_c = list(range(0, 8)), list(range(8, 16)), list(range(16, 24))
    # plain: the prompt but its last token, then one decode step per token
    runner.execute(ModelInput((Chunk(prompt[:-1], 0, table_a, False),)))
    plain = []
    for j, tok in enumerate([prompt[-1], *drafts]):
        plain.append(runner.execute(ModelInput((Chunk([tok], len(prompt) - 1 + j, table_a, True),))).logits[0])
    # speculative: the same K/V before, then one chunk of 1 + k rows, in a step with another
    # sequence's prefill (a mixed batch of many rows)
    runner.execute(ModelInput((Chunk(prompt[:-1], 0, table_b, False),)))
    out = runner.execute(ModelInput((Chunk(other, 0, table_c, True), Chunk([prompt[-1], *drafts], len(prompt) - 1,
                                                                            table_b, True)), verify=(1,))).logits
    assert out.shape[0] == 1 + 1 + len(drafts)
    for j, row in enumerate(plain):
        assert torch.equal(out[1 + j], row), f"position {j}: max diff {(out[1 + j] - row).abs().max()}"


# -- the claim: tokens identical to plain decoding ----------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    plain = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=1 << 22))
    spec = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=1 << 22, speculative_config=SPEC))
    return plain, spec


# prompts that repeat themselves (the tiny random model also falls into loops of its own)
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4,
    [40, 41, 42, 43] * 6 + [40, 41],
    [100 + i for i in range(20)] * 2,
    [7, 300, 301, 7, 302] * 5,
    [459, 11, 356, 398, 89, 356, 398, 380, 89, 356],
]


def _accepted(engine: Engine) -> int:
    return engine.stats.spec_num_accepted_tokens


def _check(engines, params: list[SamplingParams], prompts=PROMPTS) -> int:
    """Each request alone on the plain engine vs all together, then each alone, on the
    speculative one; returns the tokens the speculative engine accepted."""
    plain, spec = engines
    want = [plain.generate([p], [q])[0] for p, q in zip(prompts, params)]
    before = _accepted(spec)
    together = spec.generate(prompts, params)
    alone = [spec.generate([p], [q])[0] for p, q in zip(prompts, params)]
    for i, (w, t, a) in enumerate(zip(want, together, alone)):
        assert t.token_ids == w.token_ids and t.finish_reason == w.finish_reason, f"request {i} in a batch"
        assert t.text == w.text
        assert a.token_ids == w.token_ids, f"request {i} alone"
    return _accepted(spec) - before


def test_greedy_tokens_equal_plain_decoding(engines):
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)] * len(PROMPTS)
    assert _check(engines, params) > 0


def test_seeded_sampling_tokens_equal_plain_decoding_in_mixed_batches(engines):
    # the tiny random model's distributions are nearly flat: at low temperatures its sampled
    # streams still repeat themselves now and then, so drafts get accepted
    params = [
        SamplingParams(max_tokens=40, temperature=0.1, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.1, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=5),
        SamplingParams(max_tokens=40, temperature=0.3, top_k=50, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),  # greedy in the same batch
        SamplingParams(max_tokens=40, temperature=0.8, top_k=5, top_p=0.95, min_p=0.05, seed=6),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[4]]
    assert _check(engines, params, prompts) > 0


def test_penalties_min_tokens_logprobs_and_stops_per_accepted_token(engines):
    plain, spec = engines
    free = plain.generate([PROMPTS[4]], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)])[0]
    stop_at = free.token_ids[12]  # a token plain decoding produces mid-stream
    params = [
        SamplingParams(max_tokens=40, temperature=0.3, seed=8, repetition_penalty=1.2, frequency_penalty=0.1),
        SamplingParams(max_tokens=40, temperature=0, min_tokens=10, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(stop_at,), ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(free.text[-6:-2],)),
    ]
    assert _check(engines, params) > 0
    # logprobs of accepted tokens are those plain decoding reports
    lp = SamplingParams(max_tokens=30, temperature=0, logprobs=3, ignore_eos=True)
    outs = []
    for e in engines:
        e.add_request("lp", PROMPTS[4], lp)
        got = []
        while e.has_unfinished():
            got += [x for o in e.step() for x in (o.logprobs or ())]
        outs.append(got)
    assert outs[0] == outs[1] and len(outs[0]) == 30


def test_rollback_keeps_blocks_exact_and_the_prefix_cache_clean(engines):
    _, spec = engines
    kv, bs = spec.kv, spec.config.block_size
    before, drafts = _accepted(spec), spec.stats.spec_num_draft_tokens
    spec.add_request("r", PROMPTS[0], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    while spec.has_unfinished():
        spec.step()
        req = spec._reqs.get("r")
        if req is None:
            continue
        s = req.seq
        # between steps: computed = known tokens but the last; blocks for no rejected position
        assert s.num_computed_tokens == s.num_tokens - 1
        assert kv.blocks_needed(s.num_tokens - 1) <= len(kv.block_ids("r")) <= kv.blocks_needed(s.num_tokens)
        # every block of the sequence in the prefix index is full of its computed tokens
        for i, block_id in enumerate(kv.block_ids("r")):
            block = kv.pool.blocks[block_id]
            if block.hash is not None:
                assert (i + 1) * bs <= s.num_computed_tokens
                assert block.token_ids == tuple(s.all_token_ids[i * bs : (i + 1) * bs])
    rejected = (spec.stats.spec_num_draft_tokens - drafts) - (_accepted(spec) - before)
    assert rejected > 0 and _accepted(spec) > before  # positions were both kept and rolled back


def test_large_batches_do_not_speculate(tiny_model_dir):
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=2)
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=1 << 22, speculative_config=cfg))
    engine.generate(PROMPTS[:3], [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * 3)
    assert engine.stats.spec_num_drafts == 0  # three running > 2
    engine.generate(PROMPTS[:2], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 2)
    assert engine.stats.spec_num_drafts > 0


@pytest.mark.slow
def test_default_model_tokens_equal_plain_decoding(default_model_dir):
    text = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
            "Repeat the sentence above three times:")
    plain = Engine(EngineConfig(model=default_model_dir, kv_cache_bytes=1 << 26))
    spec = Engine(EngineConfig(model=default_model_dir, kv_cache_bytes=1 << 26, speculative_config=SPEC))
    messages = [{"role": "user", "content": text}]
    prompt = plain.encode_prompt(messages=messages)
    params = [SamplingParams(max_tokens=48, temperature=0), SamplingParams(max_tokens=48, temperature=0.7, seed=1),
              SamplingParams(max_tokens=48, temperature=1.0, top_p=0.9, top_k=40, seed=2)]
    want = [plain.generate([prompt], [p])[0].token_ids for p in params]
    got = [c.token_ids for c in spec.generate([prompt] * len(params), params)]
    assert got == want
    assert spec.stats.spec_num_accepted_tokens > 0


def test_spec_decode_counters_reach_the_workers_prometheus_registry(engines):
    from engine_workers.engine.async_engine import AsyncEngine
    from engine_workers.worker.health.metrics import WorkerMetrics

    _, spec = engines
    spec.generate([PROMPTS[0]], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)])
    st = spec.stats
    assert st.spec_num_drafts > 0 and st.spec_num_accepted_tokens > 0
    shell = AsyncEngine(spec)  # not started: only its snapshot of the engine's counters is used
    shell._update_snapshot()
    m = WorkerMetrics("m")
    m.observe_snapshot(shell.snapshot, (0, 0, 0), (0, 0, 0))
    text = m.render().decode()
    for name, value in (("drafts", st.spec_num_drafts), ("draft_tokens", st.spec_num_draft_tokens),
                        ("accepted_tokens", st.spec_num_accepted_tokens)):
        assert f'lockgate:spec_decode_num_{name}_total{{model="m"}} {float(value)}' in text


def test_a_resumed_request_continues_exactly_with_speculation_on(engines):
    """A worker that takes a request over mid-stream (resume_token_ids) reproduces plain
    decoding's remaining tokens with speculation on, whichever position it resumes at."""
    plain, spec = engines
    params = SamplingParams(max_tokens=40, temperature=0.1, seed=3, ignore_eos=True)
    want = plain.generate([PROMPTS[0]], [params])[0].token_ids
    before = _accepted(spec)
    for k in (1, 9, 17):
        spec.add_request(f"resume-{k}", PROMPTS[0], params, resume_token_ids=want[:k])
        got: list[int] = []
        while spec.has_unfinished():
            got += [t for o in spec.step() for t in o.token_ids]
        assert tuple(got) == want[k:], f"resumed at {k}"
    assert _accepted(spec) > before
