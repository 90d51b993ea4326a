"""The worker's gate on reply topics: no request runs before its reply topic is known to exist, and
a request that can never be answered is dead-lettered and committed.

A request names its own ``reply_to``. A topic that does not exist can be answered by no worker
(on a broker without auto-create every send waits out the request timeout; on one with it, a send
would create the topic for no reader). The gate asks the bus once per reply topic, before the
first request naming it is queued (:meth:`ReplySender.verify`, which caches the answer for the
reply rounds and lets concurrent requests share one check): a topic already known costs nothing,
the first request to a new one waits one metadata round trip, and one to a missing topic is
dead-lettered (``reply topic ... does not exist``) without a prefill. A topic deleted while its
requests run is found by the reply rounds instead, which report the requests through the worker's
``on_failed`` to :meth:`dead_letter`.

Concurrency: event loop only. Owned tasks: one per held request (while its topic is checked) and
one per dead letter in flight; :meth:`stop` cancels the first and gives the second a bounded wait
(a dead letter acknowledged finishes its offset, which the worker's final commit then includes).
A held request whose partition was revoked meanwhile (``job.lost``) is dropped, not queued.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from bus.base import Bus, BusError, Record
from bus.deadletter import send_dead_letter
from bus.messages import encode
from bus.topics import TopicLayout
from engine_workers.worker.ledger import Job, RequestLedger
from engine_workers.worker.reply_sender import ReplySender

log = logging.getLogger(__name__)


class ReplyGate:
    """``accept(job, held)``: queue a request whose reply topic exists (``held`` False: at once,
    from :meth:`submit`; True: after the check); ``on_dead_letter()``: count one dead letter."""

    def __init__(self, bus: Bus, layout: TopicLayout, worker_id: str, replies: ReplySender,
                 ledger: RequestLedger, accept: Callable[[Job, bool], None], on_dead_letter: Callable[[], None]) -> None:
        self.bus = bus
        self.layout = layout
        self.worker_id = worker_id
        self.replies = replies
        self.ledger = ledger
        self.accept = accept
        self.on_dead_letter = on_dead_letter
        self._held: set[asyncio.Task] = set()  # requests waiting for their reply topic's check
        self._dead_letters: set[asyncio.Task] = set()  # undeliverable requests being dead-lettered

    def __len__(self) -> int:
        """Requests held while their reply topic is checked."""
        return len(self._held)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (through ``accept``) now if its reply topic is known, else once the bus
        has confirmed the topic; dead-letter it if the topic does not exist."""
        if self.replies.known(job.req.reply_to):
            self.accept(job, False)
            return
        self._own(self._held, self._check(job), f"reply-check-{job.eid}")

    async def _check(self, job: Job) -> None:
        try:
            reason = await self.replies.verify(job.req.reply_to)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug or an unexpected bus error must not hold the request forever
            log.exception("worker %s: checking reply topic %r failed; letting %s run", self.worker_id,
                          job.req.reply_to, job.eid)
            reason = None
        if job.lost:
            return  # its partition was revoked meanwhile: the new owner has it
        if reason is None:
            self.accept(job, True)
        else:
            self.ledger.forget(job)
            await self._dead_letter(job, reason)

    def dead_letter(self, job: Job, reason: str) -> None:
        """Dead-letter ``job`` (no longer in the engine) in the background, then finish its offset."""
        self._own(self._dead_letters, self._dead_letter(job, reason), f"dlq-{job.eid}")

    def _own(self, tasks: set[asyncio.Task], coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _dead_letter(self, job: Job, reason: str) -> None:
        """Publish ``job``'s request to the dead-letter topic (its provenance in the headers), then
        finish its offset. A failure leaves it uncommitted, as a failed reply does."""
        if job.tp is None:
            return
        r = job.req
        # The request re-encoded (the record's bytes are not kept); its timestamp is the request's
        # arrival, which is its enqueued_at (the record's own stamp differs by the publish latency).
        rec = Record(job.tp.topic, job.tp.partition, job.offset, r.request_id.encode(), encode(r), int(job.arrival * 1000))
        try:
            await send_dead_letter(self.bus, self.layout, rec, reason)
        except BusError as exc:
            log.error("worker %s: dead letter of %s failed (%s); leaving it uncommitted", self.worker_id, job.eid, exc)
            return
        self.on_dead_letter()
        # Safe even if the partition was revoked and came back since: the only record at this
        # offset is this same request, whose reply topic is missing wherever it runs.
        self.ledger.offsets.finish(job.tp, job.offset)

    async def stop(self, grace_s: float) -> None:
        """Cancel the held checks (their requests stay uncommitted); wait up to ``grace_s`` for the
        dead letters in flight, then cancel them. Idempotent."""
        held = list(self._held)
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        if self._dead_letters:
            await asyncio.wait(list(self._dead_letters), timeout=grace_s)
            rest = list(self._dead_letters)
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
