"""What the worker does with a request whose replies could not be sent.

The reply sender retries a record a few times (``send_retries``, backoff from 0.1 s); when it
still fails (the broker unreachable for that long, a reply partition without a leader for longer
than the producer's request timeout, a record the broker refuses) every request in that record is
reported through ``on_failed``. Such a request's stream now has a gap, so it can only be answered
by running it again from the start (the same tokens at the same ``seq``: the reply consumer drops
what it already has). Leaving it in flight instead (as until 2026-12-04) pinned its partition's
commits for the worker's life: nothing after it was committed, its client waited out its timeout,
and every restart re-ran everything after it.

So a failed request moves through, per record (``Job.send_failures`` counts the failed runs):

1. runs 1..``reruns``: queued again (a new job for the same record, through the intake's usual
   checks: cancelled, deadline, model) after ``backoff_s`` doubling per failure;
2. then: answered ``Error(internal)`` (a small record, the likeliest to get through when only
   large ones failed), its offset finished once that is acknowledged;
3. that failing too: dead-lettered (``dlq.reason`` names the reply topic), retried until the
   dead letter is acknowledged (:mod:`engine_workers.worker.offsets.dead_letters`), then finished.

At every step the offset stays in flight, so a restart or rebalance meanwhile re-runs it
elsewhere, and the partition's watermark moves on as soon as one step succeeds. A request whose
partition moves away while it waits is dropped (``job.lost``): the new owner has it. A request
whose reply topic no longer exists (*undeliverable*: no worker could answer it) is dead-lettered
at once.

Two halves, so that the reply sender and the pipeline never need each other (the sender's failures
become re-runs, and re-runs send replies): :class:`FailedSends`, the sender's ``on_failed``, built
before the sender from the ledger and the engine alone, stops the failed run at once (marked lost:
nothing more of it is published; aborted in the engine) and posts a :class:`SendFailed`;
:class:`SendFailures` reads those posts in the task the worker owns (:meth:`SendFailures.run`) and
re-runs each request through the intake checks, answers it, or dead-letters it.

Concurrency: event loop only. The waits are loop timers, owned and cancelled by :meth:`stop`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from bus import ErrorCode
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.worker.offsets.dead_letters import DeadLetters, job_record
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.pipeline.handoff import Arrival, Stage
from engine_workers.worker.replies.answers import Answers

log = logging.getLogger(__name__)


def failed_replies_reason(topic: str, runs: int) -> str:
    """The ``dlq.reason`` of a request whose replies could never be sent."""
    return f"replies to {topic!r} could not be sent ({runs} runs)"


@dataclass(frozen=True, slots=True)
class SendFailed:
    """A run whose replies could not be sent, already stopped (lost, out of the engine).
    ``undeliverable``: why its reply topic can take nothing (it does not exist); None: the bus
    failed."""

    job: Job
    undeliverable: str | None


class FailedSends:
    """The reply sender's ``on_failed(engine id, undeliverable)``: stops the run now, posts it for
    :class:`SendFailures`. The posts are bounded by the jobs held: a run fails at most once (the
    sender forgets it, a re-run has a new engine id)."""

    def __init__(self, ledger: RequestLedger, aengine: AsyncEngine) -> None:
        self.ledger = ledger
        self.aengine = aengine
        self._posted: asyncio.Queue[SendFailed] = asyncio.Queue()

    def __len__(self) -> int:
        return self._posted.qsize()

    def report(self, eid: str, undeliverable: str | None) -> None:
        job = self.ledger.get(eid)
        if job is None:
            return
        job.lost = True  # publish nothing more of this run
        if job.admitted:
            self.aengine.abort(job.eid)
        else:
            self.ledger.forget(job)
        self._posted.put_nowait(SendFailed(job, undeliverable))

    async def get(self) -> SendFailed:
        return await self._posted.get()

    def take(self) -> SendFailed | None:
        """The oldest post, or None when there is none (without waiting)."""
        try:
            return self._posted.get_nowait()
        except asyncio.QueueEmpty:
            return None


class SendFailures:
    """Reads ``failed`` (:meth:`run`) and moves each request on: re-run into ``rerun`` (the
    intake checks), answered through ``answers``, or dead-lettered."""

    def __init__(self, worker_id: str, failed: FailedSends, ledger: RequestLedger, dead_letters: DeadLetters,
                 answers: Answers, rerun: Stage, *, reruns: int = 2, backoff_s: float = 0.5) -> None:
        if reruns < 0 or backoff_s < 0:
            raise ValueError(f"reruns and backoff_s must be >= 0, got {reruns}, {backoff_s}")
        self.worker_id = worker_id
        self.failed_sends = failed
        self.ledger = ledger
        self.dead_letters = dead_letters
        self.answers = answers
        self.rerun = rerun
        self.reruns = reruns
        self.backoff_s = backoff_s
        self.rerun_count = 0
        self._timers: set[asyncio.TimerHandle] = set()

    async def run(self) -> None:
        """Handle every failed run posted, until cancelled (the worker owns the task). A bug
        handling one is logged; it never ends the task (that would stop the worker)."""
        while True:
            f = await self.failed_sends.get()
            try:
                self.handle(f)
            except Exception:
                log.exception("worker %s: handling the failed replies of %s failed", self.worker_id, f.job.eid)

    def handle(self, f: SendFailed) -> None:
        if f.undeliverable is not None:
            if f.job.tp is not None:  # no worker could answer it: dead-lettered, then committed
                self.dead_letters.send(job_record(f.job), f.undeliverable)
        else:
            self.failed(f.job)

    def __len__(self) -> int:
        """Failed requests waiting to run again."""
        return len(self._timers)

    def failed(self, job: Job) -> None:
        if job.tp is None:
            return
        n = job.send_failures + 1
        topic = job.req.reply_to
        if n > self.reruns + 1:
            log.error("worker %s: replies of %s to %s failed %d times; dead-lettering it", self.worker_id,
                      job.eid, topic, n)
            self.dead_letters.send(job_record(job), failed_replies_reason(topic, n))
            return
        base = job.eid.rsplit("/r", 1)[0] if job.send_failures else job.eid  # our suffix only
        again = Job(f"{base}/r{n}", job.req, job.tp, job.offset, job.arrival, job.prompt_blocks, aging_from=job.aging_from,
                    send_failures=n, block_size=job.block_size)
        self.ledger.add(again)  # held (a rebalance that moves its partition marks it lost)
        if n > self.reruns:
            log.error("worker %s: replies of %s to %s failed %d times; answering it with an error", self.worker_id,
                      job.eid, topic, n)
            self.answers.error(again, ErrorCode.INTERNAL, f"replies could not be sent ({n} runs); not retried")
            return
        delay = self.backoff_s * 2 ** (n - 1)
        log.warning("worker %s: replies of %s to %s could not be sent; running it again in %.1fs", self.worker_id,
                    job.eid, topic, delay)
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def fire() -> None:
            assert handle is not None
            self._timers.discard(handle)
            if again.lost:
                return  # its partition moved away meanwhile
            self.rerun_count += 1
            self.rerun.put(Arrival(again, waited=True))

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)

    def stop(self) -> None:
        """Cancel the waits: those requests stay uncommitted (the next owner runs them). Posts not
        yet read: an undeliverable one is still dead-lettered (the worker's stop gives the dead
        letters a grace), the others stay uncommitted too. On the event loop, after the task
        running :meth:`run` was cancelled."""
        for h in self._timers:
            h.cancel()
        self._timers.clear()
        while (f := self.failed_sends.take()) is not None:
            if f.undeliverable is not None and f.job.tp is not None:
                self.dead_letters.send(job_record(f.job), f.undeliverable)
