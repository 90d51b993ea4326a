"""The worker's dead letters: sent in the background, retried until acknowledged, then committed.

A record goes to the dead-letter topic when no worker can ever answer it: undecodable, not a
request, a request whose reply topic does not exist, or one whose replies failed every time
(:mod:`engine_workers.worker.pipeline.failures`). Its offset is finished (and so committed) only once
the dead letter is acknowledged, so a lost letter never leaves a gap in the log.

A dead-letter topic that cannot be written (its leader down, the topic deleted on a broker
without auto-create, the broker unreachable) must neither kill the intake nor pin the record's
partition for the worker's life: each letter is retried with backoff (0.1 s doubling to
``MAX_BACKOFF_S``) until it is acknowledged, its partition moved to another worker (its offset is
no longer held here: the new owner dead-letters it), or :meth:`DeadLetters.stop`. Until then the
record stays in flight, uncommitted, and everything else goes on. Before this, a failed send
raised out of the intake loop and the worker stopped serving.

Concurrency: event loop only; one task per letter in flight, owned here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from bus import Bus, BusError, Record, TopicLayout, TopicPartition, encode, send_dead_letter
from engine_workers.worker.offsets.ledger import Job
from engine_workers.worker.offsets.watermark import OffsetTracker

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


def job_record(job: Job) -> Record:
    """The record of ``job``'s request, for its dead letter: the request re-encoded (the record's
    bytes are not kept) at its source topic, partition and offset; its timestamp is the request's
    arrival (its enqueued_at; the record's own stamp differs by the publish latency)."""
    assert job.tp is not None
    r = job.req
    return Record(job.tp.topic, job.tp.partition, job.offset, r.request_id.encode(), encode(r), int(job.arrival * 1000))


class DeadLetters:
    """``send(record, reason)``: dead-letter ``record`` in the background; once acknowledged,
    ``on_dead_letter()`` and its offset is finished in ``offsets``."""

    def __init__(self, bus: Bus, layout: TopicLayout, worker_id: str, offsets: OffsetTracker[TopicPartition],
                 on_dead_letter: Callable[[], None]) -> None:
        self.bus = bus
        self.layout = layout
        self.worker_id = worker_id
        self.offsets = offsets
        self.on_dead_letter = on_dead_letter
        self.failures = 0  # failed attempts, all letters together (each is retried)
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        """Dead letters not acknowledged yet."""
        return len(self._tasks)

    def send(self, record: Record, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self._send(record, reason),
                                                      name=f"dlq-{record.topic}[{record.partition}]@{record.offset}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, rec: Record, reason: str) -> None:
        tp = TopicPartition(rec.topic, rec.partition)
        backoff = FIRST_BACKOFF_S
        while True:
            try:
                await send_dead_letter(self.bus, self.layout, rec, reason)
                break
            except Exception as exc:  # BusError; anything else is a bug, logged with its traceback
                self.failures += 1
                if not self.offsets.holds(tp, rec.offset):
                    return  # its partition moved away: the new owner has the record
                log.warning("worker %s: dead letter of %s[%d]@%d failed (%s); retrying in %.1fs", self.worker_id,
                            rec.topic, rec.partition, rec.offset, exc, backoff, exc_info=not isinstance(exc, BusError))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
        self.on_dead_letter()
        # Safe even if the partition was revoked and came back since: the only record at this
        # offset is this same one, dead-lettered wherever it runs.
        self.offsets.finish(tp, rec.offset)

    async def stop(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the letters in flight (an acknowledged one finishes its offset,
        which the worker's final commit includes), then cancel the rest (left uncommitted)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        rest = list(self._tasks)
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
