"""Per-partition low-watermark commit tracking. Pure (no asyncio, no Kafka).

A worker takes records off a partition in offset order but finishes them in any order (short
requests overtake long ones; some wait in the intake). Kafka's committed offset is a single
number per partition ("everything before this is done"), so the worker may commit only up to the
lowest offset still unfinished: its *low watermark*. Every record is in flight from the moment it
is fetched (queued in the intake, running, or having its final reply sent) until the worker calls
:meth:`OffsetTracker.finish` for it (its ``Finished``/``Error``/dead letter acknowledged).

After a crash, the records at or above the committed offset are delivered again to whoever owns
the partition next; those below it were all answered. Nothing is skipped; some answered records
may run twice (the reply consumer dedupes by ``seq``).

Not thread-safe: one owner (the worker's event loop).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class _Partition:
    committed: int  # the last committed offset (or the first offset seen: nothing to commit before it)
    next_offset: int  # highest offset tracked + 1
    inflight: set[int] = field(default_factory=set)
    heap: list[int] = field(default_factory=list)  # inflight offsets, lazily pruned

    def low_watermark(self) -> int:
        while self.heap and self.heap[0] not in self.inflight:
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else self.next_offset


class OffsetTracker(Generic[K]):
    """Which offset each partition may commit. Keys are partitions (any hashable)."""

    def __init__(self) -> None:
        self._parts: dict[K, _Partition] = {}

    def track(self, tp: K, offset: int) -> None:
        """A record was fetched: it is in flight until :meth:`finish`."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        part = self._parts.get(tp)
        if part is None:
            part = self._parts[tp] = _Partition(committed=offset, next_offset=offset)
        if offset in part.inflight:
            return
        if offset < part.committed:
            # Redelivered below what we committed (a seek back): track it, never commit backwards.
            part.committed = offset
        part.inflight.add(offset)
        heapq.heappush(part.heap, offset)
        part.next_offset = max(part.next_offset, offset + 1)

    def finish(self, tp: K, offset: int) -> bool:
        """The record is answered. Returns False when it was not tracked (e.g. revoked since)."""
        part = self._parts.get(tp)
        if part is None or offset not in part.inflight:
            return False
        part.inflight.discard(offset)
        return True

    def holds(self, tp: K, offset: int) -> bool:
        """True while ``offset`` is tracked and not finished (its partition not forgotten)."""
        part = self._parts.get(tp)
        return part is not None and offset in part.inflight

    def seen(self, tp: K, offset: int) -> bool:
        """True when ``offset`` was tracked before (in flight or finished) and the partition was not
        forgotten since: a re-delivery after a rebalance that kept the partition here."""
        part = self._parts.get(tp)
        return part is not None and offset < part.next_offset and (offset >= part.committed or offset in part.inflight)

    def in_flight(self, tp: K | None = None) -> int:
        if tp is not None:
            part = self._parts.get(tp)
            return len(part.inflight) if part else 0
        return sum(len(p.inflight) for p in self._parts.values())

    def low_watermark(self, tp: K) -> int | None:
        part = self._parts.get(tp)
        return part.low_watermark() if part else None

    def committable(self) -> dict[K, int]:
        """Per partition, the offset to commit now (low watermark), for those that advanced."""
        out: dict[K, int] = {}
        for tp, part in self._parts.items():
            lw = part.low_watermark()
            if lw > part.committed:
                out[tp] = lw
        return out

    def committed(self, offsets: Mapping[K, int]) -> None:
        """Record a successful commit of ``offsets`` (as returned by :meth:`committable`)."""
        for tp, off in offsets.items():
            part = self._parts.get(tp)
            if part is not None and off > part.committed:
                part.committed = off

    def forget(self, tps: Iterable[K]) -> None:
        """Drop revoked partitions: their in-flight records are someone else's now."""
        for tp in tps:
            self._parts.pop(tp, None)

    def partitions(self) -> list[K]:
        return list(self._parts)
