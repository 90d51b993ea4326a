"""Taking requests back wherever they are: a ``Cancel`` from the control topic, and the partitions
a rebalance moved to another worker (docs/worker.md, "Cancel" and "Offsets, crash recovery, ...").

A request is queued in the intake (removed from it), admitted (aborted in the engine: its KV is
freed before the next step and its final output follows), or not yet either (held for its reply
topic's check or its resume lookup: the pipeline's intake checks read :meth:`Aborts.cancelled`
when those let it go).

:class:`Aborts` is also the group consumer's rebalance listener (:meth:`Aborts.on_revoked`,
:meth:`Aborts.on_assigned`): it asks the ledger which partitions were lost and stops their
requests; the ledger itself calls nothing back.
Runs on the event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from bus import FinishReason, TopicPartition
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.worker.intake.queue import IntakeQueue
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.replies.answers import Answers
from engine_workers.worker.replies.sender import ReplySender

RECENT_CANCELS = 10_000  # request ids remembered as cancelled: a cancel may arrive before its request


class Aborts:
    """Cancels (:meth:`cancel`, remembered for the requests that arrive later) and partitions lost
    to a rebalance (:meth:`release`)."""

    def __init__(self, aengine: AsyncEngine, ledger: RequestLedger, intake: IntakeQueue[Job], answers: Answers,
                 replies: ReplySender) -> None:
        self.aengine, self.ledger, self.intake, self.answers, self.replies = aengine, ledger, intake, answers, replies
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    def cancelled(self, request_id: str) -> bool:
        """Whether ``request_id`` was cancelled recently (the last ``RECENT_CANCELS`` cancels)."""
        return request_id in self._cancelled

    def cancel(self, request_id: str) -> int:
        """Abort ``request_id`` wherever it is here; remember it for a while (it may arrive later).
        Returns how many of its runs were stopped."""
        self._cancelled[request_id] = None
        while len(self._cancelled) > RECENT_CANCELS:
            self._cancelled.popitem(last=False)
        n = 0
        for job in self.ledger.of_request(request_id):
            if job.pending is not None and self.intake.remove(job.pending):
                job.pending = None
                self.answers.unrun(job, FinishReason.ABORT)
                n += 1
            elif job.admitted and not job.closing:
                self.aengine.abort(job.eid)  # frees its KV before the next step; Finished(abort) follows
                n += 1
        return n

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        """The consumer's rebalance, phase 1: commit what is done there (:meth:`RequestLedger.on_revoked`)."""
        await self.ledger.on_revoked(tps)

    async def on_assigned(self, tps: set[TopicPartition]) -> None:
        """The consumer's rebalance, phase 2: stop the requests of the partitions lost, then
        forget their offsets (synchronously: no output or acknowledgement lands half-way)."""
        lost = self.ledger.reassigned(tps)
        if lost:
            self.release(lost)
            self.ledger.forget_partitions(lost)

    def stop_run(self, job: Job) -> None:
        """Stop one run wherever it is and publish nothing more of it; its offset stays in flight
        (a fenced run: worker/failover/takeover.py holds its record again)."""
        if job.pending is not None and self.intake.remove(job.pending):
            job.pending = None
        job.lost = True
        self.replies.drop(job.eid)
        if job.admitted:
            self.aengine.abort(job.eid)  # its final output is swallowed
        else:
            self.ledger.forget(job)

    def release(self, lost: Set[TopicPartition]) -> None:
        """A rebalance moved ``lost`` away: drop their queued requests, abort the admitted ones and
        publish nothing more for them; the new owner re-runs them."""
        for p in self.intake.remove_if(lambda p: p.item.tp in lost):
            p.item.pending = None
            self.ledger.forget(p.item)
        for job in self.ledger.on_partitions(lost):
            if not job.lost:
                job.lost = True
                self.replies.drop(job.eid)
                if job.admitted:
                    self.aengine.abort(job.eid)  # its final output is swallowed
                else:
                    self.ledger.forget(job)
