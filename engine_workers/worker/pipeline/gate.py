"""The pipeline's second stage: no request runs before its reply topic is known to exist, and a
request that can never be answered is dead-lettered and committed.

A request names its own ``reply_to``. A topic that does not exist can be answered by no worker
(on a broker without auto-create every send waits out the request timeout; on one with it, a send
would create the topic for no reader). The gate asks the bus once per reply topic, before the
first request naming it goes on (:meth:`ReplySender.verify`, which caches the answer for the
reply rounds and lets concurrent requests share one check): a topic already known costs nothing,
the first request to a new one waits one metadata round trip, and one to a missing topic is
dead-lettered (``reply topic ... does not exist``) without a prefill. A topic deleted while its
requests run is found by the reply rounds instead (``pipeline/failures.py`` dead-letters those).

Concurrency: event loop only. Owned tasks: one per held request (while its topic is checked);
:meth:`ReplyGate.stop` cancels them (their requests stay uncommitted). A held request whose
partition was revoked meanwhile (``job.lost``) is dropped, not handed on.
"""

from __future__ import annotations

import asyncio
import logging

from engine_workers.worker.offsets.dead_letters import DeadLetters, job_record
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.pipeline.handoff import Arrival, Stage
from engine_workers.worker.replies.sender import ReplySender

log = logging.getLogger(__name__)


class ReplyGate:
    """``dead_letters``: the worker's (every dead letter of it, retried until acknowledged);
    ``next_stage``: the resume lookup."""

    def __init__(self, worker_id: str, replies: ReplySender, ledger: RequestLedger, dead_letters: DeadLetters,
                 next_stage: Stage) -> None:
        self.worker_id = worker_id
        self.replies = replies
        self.ledger = ledger
        self.dead_letters = dead_letters
        self.next_stage = next_stage
        self._held: set[asyncio.Task] = set()  # requests waiting for their reply topic's check

    def __len__(self) -> int:
        """Requests held while their reply topic is checked."""
        return len(self._held)

    def put(self, arrival: Arrival) -> None:
        """Hand ``arrival`` on now if its reply topic is known, else once the bus has confirmed
        the topic; dead-letter it if the topic does not exist."""
        job = arrival.job
        if self.replies.known(job.req.reply_to):
            self.next_stage.put(arrival)
            return
        task = asyncio.get_running_loop().create_task(self._check(job), name=f"reply-check-{job.eid}")
        self._held.add(task)
        task.add_done_callback(self._held.discard)

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
            self.next_stage.put(Arrival(job, waited=True))
        else:
            self.ledger.forget(job)
            if job.tp is not None:
                self.dead_letters.send(job_record(job), reason)

    async def stop(self) -> None:
        """Cancel the held checks (their requests stay uncommitted). Idempotent."""
        held = list(self._held)
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
