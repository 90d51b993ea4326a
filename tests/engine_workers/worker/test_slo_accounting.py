"""The worker's admission accounting (issue #52): each test fails on the defect it names.

Pure where the code is (the intake, the ledger, the decoder); the KV accounting runs the real
scheduler and block manager, and reads them as the worker reads the engine's snapshot."""

from __future__ import annotations

import time

from bus import InferenceRequest, Record, SamplingParams, encode
from engine_workers.engine.async_engine import EngineSnapshot
from engine_workers.engine.scheduler import Scheduler, SchedulerConfig
from engine_workers.engine.sequence import Sequence
from engine_workers.worker.intake.fair import FairShare
from engine_workers.worker.intake.queue import MAX_EST_WAIT_S, RateMeter, aging_start, estimate_wait
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.pipeline.admission import EngineAdmission
from engine_workers.worker.pipeline.decode import RecordDecoder
from engine_workers.worker.pipeline.handoff import Arrival, Serving
from kv_store import KVCacheManager

MODEL = "tiny"
TOPICS = {f"ns.req.{MODEL}.p{t}": t for t in range(3)}


def request(rid: str, prompt_len: int = 3, tier: int = 1, enqueued_at: float | None = None) -> InferenceRequest:
    return InferenceRequest(rid, MODEL, tuple(range(5, 5 + prompt_len)), SamplingParams(max_tokens=4), "ns.reply.x",
                            tier=tier, enqueued_at=time.time() if enqueued_at is None else enqueued_at)


# -- the wait estimate after an idle spell --------------------------------------------------------

def test_wait_estimate_decays_instead_of_jumping_to_the_cap_after_an_idle_spell() -> None:
    meter = RateMeter(window_s=10.0)
    meter.record(0.0, 8)  # a burst fills 8 slots; long requests then hold them
    before = estimate_wait(8, meter.rate(9.9))
    after = estimate_wait(8, meter.rate(10.5))  # no admission for 10 s: the window is empty
    assert after < MAX_EST_WAIT_S / 10
    assert after < before * 1.2  # continuous across the window's edge, no jump
    assert estimate_wait(8, meter.rate(40.0)) > after  # and it keeps growing while nothing moves
    assert RateMeter().rate(5.0) == 0.0  # never measured: nothing to go on


# -- fair-share state ---------------------------------------------------------------------------

def test_fair_share_forgets_tenants_the_clock_has_passed_while_the_tier_stays_busy() -> None:
    fair = FairShare(3)
    queued: list[float] = []
    # A flood keeps the tier busy for the whole run; 500 one-shot tenants come and go.
    for i in range(500):
        queued.append(fair.tag(2, "flood", 100.0))
        queued.append(fair.tag(2, f"once-{i}", 100.0))
        queued.sort()
        for _ in range(2 if len(queued) > 4 else 0):
            fair.admitted(2, queued.pop(0))
    assert fair.tenants(2) <= 8  # only the tenants whose finish tag is still ahead of the clock


# -- Job.blocks and resumed tokens --------------------------------------------------------------

def test_job_blocks_count_the_resumed_tokens() -> None:
    r = request("r", prompt_len=10)
    job = Job("r#0", r, None, 0, time.time(), 1, block_size=4)  # 10 + 1 tokens: 3 blocks
    assert job.blocks == 3
    job.resume = tuple(range(20))  # another worker published 20 tokens: prefilled with the prompt
    assert job.blocks == 8  # 10 + 20 + 1 = 31 tokens
    job.resume = ()  # the engine refused the prefix: it runs from the start again
    assert job.blocks == 3


# -- blocks reserved for admitted prompts vs the engine's chunked prefill ------------------------

class _Engine:
    def __init__(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot


def test_a_chunked_prefill_is_never_counted_twice() -> None:
    """Every step of a long prompt's chunked prefill leaves the same blocks free for the next
    request: the prompt's blocks are counted once, by the ledger until the engine has the request,
    then by the engine. Before, the ledger kept the whole prompt reserved until its first output
    token while the engine's free count already fell with each chunk."""
    kv = KVCacheManager(64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), kv)
    ledger = RequestLedger("w", 1.0)
    r = request("long", prompt_len=40)
    job = Job("long#0", r, None, 0, time.time(), -(-41 // 4), block_size=4)
    ledger.add(job)
    snap = EngineSnapshot(kv_blocks_total=64, kv_blocks_free=64)
    adm = EngineAdmission("w", _Engine(snap), ledger, None, None, None, 4, Serving())  # type: ignore[arg-type]
    ledger.admitted(job)
    expected = 64 - job.blocks
    assert adm.free_blocks() == expected  # queued for the engine: the ledger holds its blocks
    seq = Sequence(job.eid, list(r.prompt_token_ids), r.sampling)
    sched.add(seq)
    adm.on_added(job, 1)  # the engine applied the add (its future resolved) before a new snapshot
    assert adm.free_blocks() == expected
    for _ in range(6):
        out = sched.schedule()
        sched.on_step_done(out)
        adm.aengine = _Engine(EngineSnapshot(kv_blocks_total=64, kv_blocks_free=kv.num_free_blocks,
                                             kv_blocks_to_prefill=sched.blocks_to_prefill(), adds_applied=1))  # type: ignore[assignment]
        if seq.num_computed_tokens == seq.num_tokens:
            break
        assert adm.free_blocks() == expected, (seq.num_computed_tokens, kv.num_free_blocks)
    # prefilled, no output token seen yet: only the block of its first token is not taken yet
    assert seq.num_computed_tokens == 40 and not job.started
    assert adm.free_blocks() == expected + 1


# -- the record's tier and age -------------------------------------------------------------------

class _Into:
    def __init__(self) -> None:
        self.got: list[Arrival] = []

    def put(self, arrival: Arrival) -> None:
        self.got.append(arrival)


class _Letters:
    def send(self, record: Record, reason: str) -> None:
        raise AssertionError(f"dead-lettered: {reason}")


def _decoder(into: _Into, credit: float | None = 1.0) -> RecordDecoder:
    serving = Serving()
    serving.on = True
    return RecordDecoder(RequestLedger("w", 1.0), serving, _Letters(), 16, 2.0, credit, None, into,  # type: ignore[arg-type]
                         tiers=TOPICS)


def test_the_tier_is_the_topics_not_the_records() -> None:
    into = _Into()
    dec = _decoder(into)
    forged = request("jump", tier=0)  # written to the p2 topic, labelled p0
    dec.put(Record(f"ns.req.{MODEL}.p2", 0, 7, None, encode(forged), 0))
    honest = request("ok", tier=1)
    dec.put(Record(f"ns.req.{MODEL}.p1", 0, 8, None, encode(honest), 0))
    assert [a.job.req.tier for a in into.got] == [2, 1]


def test_a_forged_age_buys_at_most_the_credit() -> None:
    into = _Into()
    dec = _decoder(into)  # the default credit: 1 aging period (2 s)
    before = time.time()
    dec.put(Record(f"ns.req.{MODEL}.p2", 0, 1, None, encode(request("old", tier=2, enqueued_at=1.0)), 0))
    job = into.got[0].job
    assert job.order_time >= before - 2.0  # not year 1970: at most one period before its fetch
    assert aging_start(1.0, 100.0, 2.0, 1.0) == 98.0
