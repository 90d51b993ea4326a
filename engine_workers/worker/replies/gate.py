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

Concurrency: event loop only. Owned tasks: one per held request (while its topic is checked), and
the worker's :class:`DeadLetters` (one task per dead letter in flight, retried until acknowledged);
:meth:`stop` cancels the first and gives the second a bounded wait (a dead letter acknowledged
finishes its offset, which the worker's final commit then includes).
A held request whose partition was revoked meanwhile (``job.lost``) is dropped, not queued.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from bus import Bus, TopicLayout
from engine_workers.worker.offsets.dead_letters import DeadLetters, job_record
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.replies.sender import ReplySender

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
        # Every dead letter of the worker (undecodable records too): retried until acknowledged.
        self.dead_letters = DeadLetters(bus, layout, worker_id, ledger.offsets, on_dead_letter)

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
            self.dead_letter(job, reason)

    def dead_letter(self, job: Job, reason: str) -> None:
        """Dead-letter ``job`` (no longer in the engine) in the background, retried until
        acknowledged (:class:`DeadLetters`), then finish its offset."""
        if job.tp is not None:
            self.dead_letters.send(job_record(job), reason)

    def _own(self, tasks: set[asyncio.Task], coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def stop(self, grace_s: float) -> None:
        """Cancel the held checks (their requests stay uncommitted); wait up to ``grace_s`` for the
        dead letters in flight, then cancel them. Idempotent."""
        held = list(self._held)
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await self.dead_letters.stop(grace_s)
