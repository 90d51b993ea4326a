"""Reading a time window of a topic's log: what ``lockgate replay`` and ``lockgate dlq`` share.

A group-less consumer starts at ``since_ms`` (Kafka ``offsets_for_times``; the memory bus the
same) and reads until every assigned partition has passed ``until_ms``, ``limit`` records were
kept, or nothing arrived for ``idle_s`` (caught up: a partition with nothing after ``until_ms``
never says it has passed). Commits nothing, joins no group, creates no topic it was not asked to
read. Cancellation: the consumer is stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from bus.base import Bus, Record, TopicPartition


async def read_time_window(bus: Bus, topics: Sequence[str], since_ms: int, until_ms: int, *,
                           limit: int = 100_000, idle_s: float = 2.0) -> list[Record]:
    """The records of ``topics`` with ``since_ms <= timestamp <= until_ms``, in the order read
    (each partition's in offset order), at most ``limit``."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if until_ms < since_ms:
        raise ValueError("until is before since")
    consumer = bus.consumer(list(topics), group_id=None, start_from=since_ms)
    out: list[Record] = []
    passed: set[TopicPartition] = set()
    loop = asyncio.get_running_loop()
    await consumer.start()
    try:
        last = loop.time()
        while loop.time() - last < idle_s and len(out) < limit:
            records = await consumer.getmany(timeout_ms=200, max_records=min(2048, limit - len(out)))
            if records:
                last = loop.time()
            for rec in records:
                if rec.timestamp_ms > until_ms:
                    passed.add(rec.tp)
                elif rec.timestamp_ms >= since_ms:
                    out.append(rec)
            assigned = consumer.assignment()
            if assigned and passed >= assigned:
                break
    finally:
        await consumer.stop()
    return out[:limit]
