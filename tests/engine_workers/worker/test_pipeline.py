"""The worker's pipeline, stage by stage (engine_workers/worker/pipeline/): each stage hands an
``Arrival`` to the successor it was given, answers or dead-letters what it cannot pass, and never
calls back into a stage before it; reruns enter at the intake checks; the rebalance listener drives
the ledger, which calls nothing back. And one request's walk through a real worker enters each
stage once, in order."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from bus import (
    ErrorCode,
    FinishReason,
    InferenceRequest,
    MemoryBus,
    Record,
    SamplingParams,
    TopicLayout,
    TopicPartition,
    encode,
)
from engine_workers.worker.actor import Worker, WorkerConfig
from engine_workers.worker.intake.queue import IntakePolicy, IntakeQueue
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.pipeline.checks import IntakeChecks
from engine_workers.worker.pipeline.decode import RecordDecoder
from engine_workers.worker.pipeline.failures import FailedSends, SendFailures
from engine_workers.worker.pipeline.gate import ReplyGate
from engine_workers.worker.pipeline.handoff import Arrival, Serving
from engine_workers.worker.pipeline.resume import ResumeFinder
from tests.engine_workers.worker.test_worker_memory import (  # noqa: F401 - pytest fixtures, used by name
    MODEL,
    Replies,
    layout,
    make_engine,
    publish,
    req,
    tiny_dir,
)
from tests.waiting import wait_until

TP = TopicPartition("t.req.tiny.p1", 0)


def request(rid: str = "r", **kw) -> InferenceRequest:
    return InferenceRequest(rid, kw.pop("model", MODEL), (5, 6, 7), SamplingParams(max_tokens=4), "t.reply.test",
                            tier=1, enqueued_at=kw.pop("enqueued_at", time.time()), **kw)


def job(rid: str = "r", offset: int = 0, **kw) -> Job:
    r = request(rid, **kw)
    return Job(f"{rid}#0", r, TP, offset, r.enqueued_at, 1)


class Into:
    """A successor stage that records what it was handed."""

    def __init__(self) -> None:
        self.got: list[Arrival] = []

    def put(self, arrival: Arrival) -> None:
        self.got.append(arrival)


class Letters:
    def __init__(self) -> None:
        self.sent: list[tuple[Record, str]] = []

    def send(self, record: Record, reason: str) -> None:
        self.sent.append((record, reason))


class Answered:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def error(self, j: Job, code: str, message: str) -> None:
        self.calls.append(("error", j.eid, code))

    def unrun(self, j: Job, reason: str) -> None:
        self.calls.append(("unrun", j.eid, reason))


def serving(on: bool = True) -> Serving:
    s = Serving()
    s.on = on
    return s


def record(value: bytes, offset: int = 0) -> Record:
    return Record(TP.topic, TP.partition, offset, b"k", value, 0)


# -- decode -----------------------------------------------------------------------------------------


def test_decode_hands_a_new_job_on_once_and_dead_letters_junk() -> None:
    ledger, letters, into = RequestLedger("w", 0.0), Letters(), Into()
    dec = RecordDecoder(ledger, serving(), letters, 16, 2.0, None, None, into)  # type: ignore[arg-type]
    dec.put(record(encode(request("a")), 0))
    dec.put(record(encode(request("a")), 0))  # re-delivered: held already
    dec.put(record(b"junk", 1))
    assert len(into.got) == 1 and not into.got[0].waited
    j = into.got[0].job
    assert j.req.request_id == "a" and (j.tp, j.offset, j.blocks) == (TP, 0, 1) and ledger.get(j.eid) is j
    assert [r.offset for r, _ in letters.sent] == [1] and letters.sent[0][1]  # with its reason


def test_decode_holds_nothing_back_into_the_pipeline_while_not_serving() -> None:
    ledger, into = RequestLedger("w", 0.0), Into()
    dec = RecordDecoder(ledger, serving(False), Letters(), 16, 2.0, None, None, into)  # type: ignore[arg-type]
    dec.put(record(encode(request("a"))))
    assert not into.got and ledger.offsets.holds(TP, 0)  # tracked, so never committed here


# -- checks -----------------------------------------------------------------------------------------


class Cancels:
    def __init__(self, *ids: str) -> None:
        self.ids = set(ids)

    def cancelled(self, rid: str) -> bool:
        return rid in self.ids


def test_checks_answer_what_cannot_run_and_pass_the_rest_as_handed() -> None:
    answers, into = Answered(), Into()
    checks = IntakeChecks(MODEL, serving(), Cancels("c"), answers, into)  # type: ignore[arg-type]
    ok = Arrival(job("ok"), waited=True)
    checks.put(ok)
    checks.put(Arrival(job("m", model="other")))
    checks.put(Arrival(job("c")))
    checks.put(Arrival(job("d", deadline=time.time() - 1)))
    assert into.got == [ok]  # the same value, ``waited`` kept
    assert answers.calls == [("error", "m#0", ErrorCode.INVALID_REQUEST), ("unrun", "c#0", FinishReason.ABORT),
                             ("error", "d#0", ErrorCode.EXPIRED)]
    IntakeChecks(MODEL, serving(False), Cancels(), answers, into).put(Arrival(job("late")))  # type: ignore[arg-type]
    assert len(into.got) == 1


# -- reply gate, resume -----------------------------------------------------------------------------


class Topics:
    def __init__(self, known: bool, missing: str | None = None) -> None:
        self._known, self.missing = known, missing

    def known(self, topic: str) -> bool:
        return self._known

    async def verify(self, topic: str) -> str | None:
        await asyncio.sleep(0)
        return self.missing

    def partition_count(self, topic: str) -> int | None:
        return 1


async def test_gate_passes_a_known_topic_at_once_and_a_checked_one_as_waited() -> None:
    ledger, letters, into = RequestLedger("w", 0.0), Letters(), Into()
    a = Arrival(job("a"))
    ReplyGate("w", Topics(True), ledger, letters, into).put(a)  # type: ignore[arg-type]
    assert into.got == [a]
    gate = ReplyGate("w", Topics(False), ledger, letters, into)  # type: ignore[arg-type]
    gate.put(Arrival(job("b")))
    assert len(gate) == 1 and len(into.got) == 1
    await wait_until(lambda: len(into.got) == 2)
    assert into.got[1].job.eid == "b#0" and into.got[1].waited


async def test_gate_dead_letters_a_request_to_a_missing_topic() -> None:
    ledger, letters, into = RequestLedger("w", 0.0), Letters(), Into()
    gate = ReplyGate("w", Topics(False, missing="reply topic gone"), ledger, letters, into)  # type: ignore[arg-type]
    j = job("x", offset=7)
    ledger.add(j)
    gate.put(Arrival(j))
    await wait_until(lambda: letters.sent)
    assert not into.got and ledger.get(j.eid) is None
    assert [(r.offset, why) for r, why in letters.sent] == [(7, "reply topic gone")]
    await gate.stop()


async def test_resume_passes_a_request_no_other_worker_had_as_handed() -> None:
    into = Into()
    finder = ResumeFinder(MemoryBus(), "w", lambda j, f: None, lambda tp: None, lambda t: 1,  # type: ignore[arg-type]
                          lambda n: None, into)
    a = Arrival(job("a"))
    finder.put(a)  # its partition was never assigned here before: no lookup
    assert into.got == [a]


# -- send failures: re-runs enter at the checks -----------------------------------------------------


class Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, eid: str) -> None:
        self.aborted.append(eid)


class Finals:
    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []

    def error(self, j: Job, code: str, message: str) -> None:
        self.errors.append((j.eid, code))


async def test_a_failed_send_stops_the_run_at_once_and_reruns_it_into_the_checks() -> None:
    ledger, engine, letters, finals, checks = RequestLedger("w", 0.0), Engine(), Letters(), Finals(), Into()
    failed = FailedSends(ledger, engine)  # type: ignore[arg-type]
    failures = SendFailures("w", failed, ledger, letters, finals, checks, reruns=1, backoff_s=0.0)  # type: ignore[arg-type]
    running, queued = job("a"), job("b", offset=1)
    for j in (running, queued):
        ledger.add(j)
    ledger.admitted(running)
    failed.report(running.eid, None)  # the reply sender's on_failed
    failed.report(queued.eid, "reply topic 't.reply.test' does not exist")
    failed.report("unknown#0", None)  # not held (its partition moved): nothing
    # synchronous: nothing more of either run is published, the running one is aborted
    assert running.lost and queued.lost and engine.aborted == [running.eid] and ledger.get(queued.eid) is None
    assert len(failed) == 2
    task = asyncio.get_running_loop().create_task(failures.run())
    try:
        await wait_until(lambda: checks.got and letters.sent)
        (again,) = checks.got
        assert again.waited and again.job.eid == "a#0/r1" and again.job.send_failures == 1
        assert ledger.get(again.job.eid) is again.job
        assert [(r.offset, "does not exist" in why) for r, why in letters.sent] == [(1, True)]
        ledger.admitted(again.job)
        failed.report(again.job.eid, None)  # out of re-runs: answered with an error
        await wait_until(lambda: finals.errors)
        assert finals.errors == [("a#0/r2", ErrorCode.INTERNAL)] and len(checks.got) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# -- rebalance: Aborts drives the ledger ------------------------------------------------------------


async def test_a_lost_partition_stops_its_requests_and_forgets_its_offsets() -> None:
    from engine_workers.worker.aborts import Aborts

    class Sender:
        def __init__(self) -> None:
            self.dropped: list[str] = []

        def drop(self, key: str) -> None:
            self.dropped.append(key)

    ledger, engine, sender = RequestLedger("w", 0.0), Engine(), Sender()
    intake: IntakeQueue[Job] = IntakeQueue(IntakePolicy())
    aborts = Aborts(engine, ledger, intake, Answered(), sender)  # type: ignore[arg-type]
    other = TopicPartition(TP.topic, 1)
    await aborts.on_assigned({TP, other})
    running, queued, kept = job("a", 0), job("b", 1), Job("c#0", request("c"), other, 0, time.time(), 1)
    for j in (running, queued, kept):
        assert ledger.fetched(j.tp, j.offset)  # type: ignore[arg-type]
        ledger.add(j)
    ledger.admitted(running)
    queued.pending = intake.push("b", 1, queued.arrival, None, queued)
    await aborts.on_revoked({TP, other})
    await aborts.on_assigned({other})  # TP moved away
    assert engine.aborted == [running.eid] and sender.dropped == [running.eid] and running.lost
    assert len(intake) == 0 and ledger.get(queued.eid) is None and not kept.lost
    assert not ledger.offsets.holds(TP, 0) and ledger.offsets.holds(other, 0)


# -- one walk through a real worker -----------------------------------------------------------------


async def test_a_request_walks_each_stage_once_in_order(tiny_dir: Path, layout: TopicLayout) -> None:
    walk: list[str] = []
    async with MemoryBus() as bus:
        w = Worker(WorkerConfig(MODEL, layout=layout), bus, make_engine(tiny_dir))
        p = w.stages.pipeline
        for name in ("gate", "resume", "checks", "admission"):
            stage = getattr(p, name)
            put = stage.put

            def spy(arrival: Arrival, _name: str = name, _put=put) -> None:
                walk.append(_name)
                _put(arrival)

            stage.put = spy  # type: ignore[method-assign]
        decode_put = p.decode.put

        def decode_spy(rec: Record) -> None:
            walk.append("decode")
            decode_put(rec)

        p.decode.put = decode_spy  # type: ignore[method-assign]
        async with w:
            replies = Replies(bus, layout.reply_topic("test"))
            await replies.consumer.start()
            await publish(bus, layout, req("r", layout, max_tokens=3))
            await replies.wait(["r"], 30)
        assert walk == ["decode", "gate", "resume", "checks", "admission"]
        assert replies.final["r"].num_tokens == 3  # type: ignore[union-attr]
