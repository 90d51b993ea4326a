"""A resumed request is bit-exact (issue 50): a request resumed from its prompt and the output
tokens already published (``resume_token_ids``: a takeover after a worker died, a rebalance),
alone in a fresh engine, continues with the very tokens *and the very log-probabilities* of the
uninterrupted run, which ran in a batch with others.

Why it can fail: the prefill and the decode attention paths sum a row in different orders, so a
resume that prefilled prompt + sent tokens computed the sent positions' attention a few ulps away
from the decodes that first produced them; with bf16 activations (``--dtype auto`` on an AMX
host) that flipped tokens within a few steps (6 of 18 resumes of the default model,
docs/worker.md, Failover). The engine replays sent tokens as decode rows of their own positions
(engine.scheduler); the log-probabilities compared here show any last-bit difference in the
logits, whether or not it flips a token.

Every test runs at each ISA level this host runs (the ``isa`` fixture: the suite pins ``avx512``
on AMX hosts, this module runs ``amx`` too), in float32, with bf16 linear weights, and at the
``amx`` level with ``--dtype auto`` (bf16 on AMX tiles, the default there). The prefix cache's
part: a resume that finds the first run's blocks (prompt positions prefilled, outputs decoded)
stays exact, and one whose output positions a longer *prompt* filled before (the same tokens,
prefilled) does not take those blocks (kv_store/hashing.py). And a prompt position computed alone
(a prompt's last token after a prefix-cache hit) is a prefill row, as it is in a longer chunk."""

from __future__ import annotations

import random

import pytest

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.kernels import isa as isa_levels
from lockgate_types import SamplingParams

pytestmark = pytest.mark.usefixtures("isa")

N = 48  # tokens per request
KS = (5, 23, 40)  # resume points: tokens already sent
BLOCK = 16


def params() -> list[SamplingParams]:
    greedy = [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=1) for _ in range(3)]
    seeded = [SamplingParams(temperature=t, seed=s, top_p=p, max_tokens=N, ignore_eos=True, logprobs=1)
              for t, s, p in ((0.8, 11, 1.0), (1.0, 4242, 0.95), (1.2, 7, 0.9))]
    return greedy + seeded


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(50)
    # lengths around and on block edges (64: the outputs start a block)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (7, 16, 19, 33, 50, 64)]


Run = tuple[list[int], list[tuple]]  # tokens and their log-probabilities, as published


def drain(engine: Engine) -> dict[str, Run]:
    got: dict[str, Run] = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            toks, lps = got.setdefault(o.request_id, ([], []))
            toks.extend(o.token_ids)
            lps.extend(o.logprobs or ())
    assert not engine.has_unfinished()
    return got


def new_engine(model: str, dtype: str) -> Engine:
    return Engine(EngineConfig(model=model, dtype=dtype, kv_cache_bytes=16 << 20, max_num_seqs=8,
                               block_size=BLOCK))


def first_runs(engine: Engine) -> tuple[list[list[int]], list[SamplingParams], list[Run]]:
    """The requests, run together as one batch (their decodes share every step)."""
    ps, sp = prompts(engine.loaded.spec.vocab_size), params()
    for i, (p, s) in enumerate(zip(ps, sp)):
        engine.add_request(f"r{i}", p, s)
    runs = drain(engine)
    full = [runs[f"r{i}"] for i in range(len(ps))]
    assert all(len(t) == N and len(lp) == N for t, lp in full)
    return ps, sp, full


def resume_alone(engine: Engine, rid: str, prompt: list[int], sp: SamplingParams, full: Run, k: int) -> None:
    engine.add_request(rid, prompt, sp, resume_token_ids=full[0][:k])
    got = drain(engine)[rid]
    assert got[0] == full[0][k:], f"{rid}: tokens differ after resuming at {k}"
    assert got[1] == full[1][k:], f"{rid}: log-probabilities differ after resuming at {k} (logits not bit-exact)"


@pytest.fixture(scope="module", params=["float32", "bfloat16", "auto"])
def dtype(request: pytest.FixtureRequest, isa: str) -> str:
    if request.param == "auto" and isa != "amx":
        pytest.skip("--dtype auto is float32 below the amx level: the float32 case")
    return request.param


@pytest.fixture(scope="module")
def batch(tiny_model_dir: str, dtype: str):
    engine = new_engine(tiny_model_dir, dtype)
    return engine, first_runs(engine)


def test_each_request_resumed_alone_in_a_fresh_engine_continues_bit_exactly(tiny_model_dir, dtype, batch):
    _, (ps, sp, full) = batch
    for k in KS:
        engine = new_engine(tiny_model_dir, dtype)  # another worker: nothing of the first run cached
        for i in range(len(ps)):
            resume_alone(engine, f"r{i}@{k}", ps[i], sp[i], full[i], k)


def test_a_resume_that_finds_the_first_runs_blocks_cached_is_exact(batch):
    """The same engine (a worker that resumes its own request: a rebalance back, a preemption):
    the first run's full blocks are cached, its decoded positions among them."""
    engine, (ps, sp, full) = batch
    for i in range(len(ps)):
        k = KS[-1]
        engine.add_request(f"again{i}", ps[i], sp[i], resume_token_ids=full[i][0][:k])
        got = drain(engine)[f"again{i}"]
        assert (got[0], got[1]) == (full[i][0][k:], full[i][1][k:])
    # the output blocks were hits (outputs decode-computed, keyed so): only the tail was replayed
    assert engine.kv.stats.hits >= sum((len(p) + KS[-1] - 1) // BLOCK * BLOCK for p in ps)


def test_a_resume_does_not_take_output_positions_a_prompt_prefilled(tiny_model_dir, dtype, batch):
    """Another engine ran a request whose *prompt* is this one's prompt and sent tokens (the same
    tokens at the same positions, prefilled): its blocks past this prompt are not this resume's."""
    _, (ps, sp, full) = batch
    engine = new_engine(tiny_model_dir, dtype)
    k = KS[-1]
    for i in range(len(ps)):
        engine.add_request(f"longer{i}", ps[i] + full[i][0][:k], SamplingParams(temperature=0, max_tokens=1))
    drain(engine)
    for i in range(len(ps)):
        engine.add_request(f"resumed{i}", ps[i], sp[i], resume_token_ids=full[i][0][:k])
        got = drain(engine)[f"resumed{i}"]
        assert (got[0], got[1]) == (full[i][0][k:], full[i][1][k:])


def test_a_prompt_whose_last_token_follows_a_prefix_hit_is_exact(tiny_model_dir, dtype, batch):
    """Not a resume, the same rule: a prompt position is a prefill row even when it is computed
    alone (the 33-token prompt after a hit on its 2 full blocks leaves 1 token: it was a decode row,
    a few ulps off, and every later token inherited that)."""
    _, (ps, sp, full) = batch
    engine = new_engine(tiny_model_dir, dtype)
    for i, p in enumerate(ps):
        if len(p) < BLOCK:
            continue
        engine.add_request(f"shares{i}", p[: len(p) // BLOCK * BLOCK] + [5] * 20, SamplingParams(temperature=0, max_tokens=1))
        drain(engine)
        engine.add_request(f"again{i}", p, sp[i])
        got = drain(engine)[f"again{i}"]
        assert got == (full[i][0], full[i][1]), f"r{i}: {len(p)}-token prompt after a hit on its full blocks"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_default_model_resumes_bit_exactly(default_model_dir, isa):
    """SmolLM2-135M (the default model) with ``--dtype auto``, where the prefill/decode difference
    flipped tokens (on an AMX host: bf16 on tiles) at the host's best level."""
    if isa != isa_levels.host_isa():
        pytest.skip("the default model runs at the host's best level only")
    engine = new_engine(default_model_dir, "auto")
    ps, sp, full = first_runs(engine)
    for k in KS:
        fresh = new_engine(default_model_dir, "auto")
        for i in range(len(ps)):
            resume_alone(fresh, f"r{i}@{k}", ps[i], sp[i], full[i], k)
