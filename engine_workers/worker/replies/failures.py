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
partition moves away while it waits is dropped (``job.lost``): the new owner has it.

Concurrency: event loop only. The waits are loop timers, owned and cancelled by :meth:`stop`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from bus import ErrorCode
from engine_workers.worker.offsets.dead_letters import DeadLetters, job_record
from engine_workers.worker.offsets.ledger import Job, RequestLedger

log = logging.getLogger(__name__)


def failed_replies_reason(topic: str, runs: int) -> str:
    """The ``dlq.reason`` of a request whose replies could never be sent."""
    return f"replies to {topic!r} could not be sent ({runs} runs)"


class SendFailures:
    """``rerun(job)``: queue a job again (the worker's intake path); ``answer(job, code, message)``:
    close a job with an ``Error`` reply. ``failed(job)`` handles one failed job (already out of the
    reply sender, marked lost and aborted in the engine by the worker)."""

    def __init__(self, worker_id: str, ledger: RequestLedger, dead_letters: DeadLetters,
                 rerun: Callable[[Job], None], answer: Callable[[Job, str, str], None], *,
                 reruns: int = 2, backoff_s: float = 0.5) -> None:
        if reruns < 0 or backoff_s < 0:
            raise ValueError(f"reruns and backoff_s must be >= 0, got {reruns}, {backoff_s}")
        self.worker_id = worker_id
        self.ledger = ledger
        self.dead_letters = dead_letters
        self.rerun = rerun
        self.answer = answer
        self.reruns = reruns
        self.backoff_s = backoff_s
        self.rerun_count = 0
        self._timers: set[asyncio.TimerHandle] = set()

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
        again = Job(f"{base}/r{n}", job.req, job.tp, job.offset, job.arrival, job.blocks, aging_from=job.aging_from,
                    send_failures=n)
        self.ledger.add(again)  # held (a rebalance that moves its partition marks it lost)
        if n > self.reruns:
            log.error("worker %s: replies of %s to %s failed %d times; answering it with an error", self.worker_id,
                      job.eid, topic, n)
            self.answer(again, ErrorCode.INTERNAL, f"replies could not be sent ({n} runs); not retried")
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
            self.rerun(again)

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)

    def stop(self) -> None:
        """Cancel the waits: those requests stay uncommitted (the next owner runs them)."""
        for h in self._timers:
            h.cancel()
        self._timers.clear()
