"""Reading a time window of a topic's log: what ``lockgate replay`` and ``lockgate dlq`` share, the
window's bounds as their command lines take them (:func:`parse_time_ms`) and the read itself.

A group-less consumer starts at ``since_ms`` (Kafka ``offsets_for_times``; the memory bus the
same) and reads until every assigned partition has passed ``until_ms``, ``limit`` records were
kept, or nothing arrived for ``idle_s`` (caught up: a partition with nothing after ``until_ms``
never says it has passed). Commits nothing, joins no group, creates no topic it was not asked to
read. Cancellation: the consumer is stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from bus.base import Bus, Record, TopicPartition


def parse_time_ms(text: str, now_ms: int | None = None) -> int:
    """``1718000000000`` (ms) | ISO 8601 (naive = UTC) | ``now`` | ``15m`` / ``2h`` / ``30s`` / ``1d``
    ago, with or without a leading ``-`` (on a command line ``--since 15m`` or ``--since=-15m``:
    argparse takes a bare ``-15m`` for an option)."""
    t = str(text).strip()
    now = int(time.time() * 1000) if now_ms is None else now_ms
    if t == "now":
        return now
    if t.lstrip("-").isdigit() and not t.startswith("-"):
        return int(t)
    ago = t[1:] if t.startswith("-") else t
    if ago[-1:] in ("s", "m", "h", "d") and ago[:-1].replace(".", "", 1).isdigit():
        mult = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}[ago[-1]]
        return now - int(float(ago[:-1]) * mult)
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a time: {text!r} (use ms since the epoch, ISO 8601, 'now' or 15m for 15 minutes ago)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


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
