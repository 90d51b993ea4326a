"""What the worker knows about its reply topics: their partition counts, and which ones do not
exist (docs/worker.md, "Outputs").

A reply topic that does not exist is not a failure that a retry or another worker can mend: its
requests are *undeliverable* (:class:`Undeliverable`; the worker dead-letters and commits them).
A topic not found is asked for again over ~0.7 s (``MISSING_RECHECK_S``) before it counts as
missing, as a topic its requester has just created may not be in every broker's metadata yet; one
found missing is remembered for ``MISSING_TTL_S`` (:meth:`ReplyTopics.still_missing`), so a flood of
requests naming it costs one metadata request each, not a prefill each. Partition counts are
cached (up to ``MAX_CACHED_TOPICS`` topics: reply topics may be per request) for
:class:`~engine_workers.worker.reply_sender.ReplySender`'s rounds, which group a round by the
partition each request id maps to; the worker's intake asks :meth:`ReplyTopics.verify` before
the first request naming a topic runs (engine_workers/worker/replies/gate.py).

Concurrency: called from the event loop only; :meth:`ReplyTopics.stop` cancels the checks in progress.
"""

from __future__ import annotations

import asyncio

from bus import Bus, BusError, UnknownTopicError

MAX_CACHED_TOPICS = 10_000  # partition counts remembered (reply topics may be per request)
MISSING_RECHECK_S = (0.1, 0.2, 0.4)  # waits before a reply topic not found counts as missing
MISSING_TTL_S = 2.0  # how long a topic found missing is remembered (``still_missing``)


class Undeliverable(Exception):
    """The reply topic does not exist: no retry or other worker can deliver these replies."""


def missing_topic_reason(topic: str) -> str:
    """Why a request naming ``topic`` is undeliverable: the text of its dead letter's ``dlq.reason``
    (the same whether the reply rounds or the worker's intake found the topic missing)."""
    return f"reply topic {topic!r} does not exist"


class ReplyTopics:
    """Partition counts of the reply topics that exist, and the ones found missing."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._counts: dict[str, int] = {}  # topic -> partition count
        self._missing: dict[str, float] = {}  # topic -> when (loop time) it was found missing
        self._verifying: dict[str, asyncio.Task] = {}  # topic -> its check in progress (verify)

    async def count(self, topic: str) -> int | None:
        """The topic's partition count (cached); ``None`` when the bus could not be asked (the
        records are then keyed one by one, as Kafka would place them). Raises
        :class:`Undeliverable` when the topic does not exist."""
        n = self._counts.get(topic)
        if n is None:
            try:
                n = len(await self.partitions(topic))  # Undeliverable (not a BusError) propagates
            except BusError:
                return None
            self._remember_count(topic, n)
        return n

    def _remember_count(self, topic: str, n: int) -> None:
        if len(self._counts) >= MAX_CACHED_TOPICS:
            self._counts.clear()
        self._counts[topic] = n

    async def partitions(self, topic: str) -> list[int]:
        """``partitions_for``; a topic not found is asked for again after each of
        ``MISSING_RECHECK_S``, then raises :class:`Undeliverable`. Other ``BusError``s propagate."""
        for wait in (*MISSING_RECHECK_S, None):
            try:
                return await self.bus.partitions_for(topic)
            except UnknownTopicError:
                if wait is None:
                    if len(self._missing) >= MAX_CACHED_TOPICS:
                        self._missing.clear()
                    self._missing[topic] = asyncio.get_running_loop().time()
                    raise Undeliverable(missing_topic_reason(topic)) from None
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    def partition_count(self, topic: str) -> int | None:
        """``topic``'s partition count when cached (it existed when last asked), else None."""
        return self._counts.get(topic)

    def known(self, topic: str) -> bool:
        """True when ``topic``'s partition count is cached: it existed when last asked."""
        return topic in self._counts

    async def verify(self, topic: str) -> str | None:
        """Check that ``topic`` exists before a request naming it runs: ``None`` when it does (its
        partition count is then cached for the reply rounds) or when the bus could not be asked
        (the rounds check again); the dead letter's reason when it does not, after the rechecks of
        ``MISSING_RECHECK_S`` (or one check while it is remembered missing). Concurrent calls for
        one topic share one check. Cancelling a caller does not cancel the shared check;
        :meth:`stop` does."""
        if topic in self._counts:
            return None
        task = self._verifying.get(topic)
        if task is None:
            task = self._verifying[topic] = asyncio.get_running_loop().create_task(self._verify(topic),
                                                                                   name=f"verify-{topic}")

            def done(t: asyncio.Task) -> None:
                if self._verifying.get(topic) is t:
                    del self._verifying[topic]

            task.add_done_callback(done)
        return await asyncio.shield(task)

    async def _verify(self, topic: str) -> str | None:
        if await self.still_missing(topic):
            return missing_topic_reason(topic)
        try:
            await self.count(topic)
        except Undeliverable as exc:
            return str(exc)
        return None

    async def still_missing(self, topic: str) -> bool:
        """True when ``topic`` was found missing in the last ``MISSING_TTL_S`` and the bus still
        does not know it (asked once more, so a topic created since is never taken for missing).
        For the intake: a flood of requests naming a missing reply topic is dead-lettered before
        it runs, at the cost of one metadata request each, instead of a prefill each."""
        found = self._missing.get(topic)
        if found is None:
            return False
        if asyncio.get_running_loop().time() - found > MISSING_TTL_S:
            del self._missing[topic]
            return False
        try:
            parts = await self.bus.partitions_for(topic)
        except UnknownTopicError:
            return True
        except BusError:
            return False  # could not ask: let it run, the reply rounds check again
        del self._missing[topic]
        self._remember_count(topic, len(parts))
        return False

    def forget_count(self, topic: str) -> None:
        """Drop ``topic``'s cached count: it may be stale (the topic deleted or re-created)."""
        self._counts.pop(topic, None)

    async def stop(self) -> None:
        """Cancel the checks in progress (their callers get ``CancelledError``)."""
        tasks = list(self._verifying.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._verifying.clear()
