"""The memory bus's storage: one append-only log per partition, kept by column.

Separate from :mod:`bus.memory` (the broker, groups and consumers) because it is the one part with
a memory and GC story of its own; nothing here knows about asyncio or consumers.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from bus.base import Record


class PartitionLog:
    """An append-only log, stored by column: ``keys``, ``values``, ``stamps`` (ms) and
    ``headers`` lists, live from index ``head``; ``start`` is the offset of index ``head``.

    Why columns and not a list of :class:`Record`: a retained ``Record`` is a GC-tracked object,
    and a partition holds up to 100,000 of them. Each one counted toward the young generation's
    threshold and was traversed and promoted by the collector: young-generation pauses that grew
    with the log and showed up in the edge's streaming latency (figures in docs/benchmarks.md,
    Edge; `lockgate bench edge` reports them as edge_gc_pause_ms_max).
    bytes, ints and the shared empty-headers tuple are not tracked, so a retained record costs
    the collector nothing; readers get fresh ``Record`` objects, which die young.

    Reading at an offset is a slice, O(records read). Dropping from the head only moves ``head``;
    the dead prefix is deleted once it is at least half the lists (and >= 1,024), so memory stays
    within 2x the retained records and each record is moved O(1) times amortised.
    """

    __slots__ = ("topic", "index", "keys", "values", "stamps", "headers", "head", "start")

    def __init__(self, topic: str, index: int) -> None:
        self.topic, self.index = topic, index
        self.keys: list[bytes | None] = []
        self.values: list[bytes] = []
        self.stamps: list[int] = []
        self.headers: list[tuple[tuple[str, bytes], ...]] = []
        self.head = 0
        self.start = 0

    def __len__(self) -> int:
        return len(self.values) - self.head

    @property
    def end(self) -> int:
        return self.start + len(self.values) - self.head

    def append(self, key: bytes | None, value: bytes, stamp_ms: int, headers: tuple) -> int:
        """Append one record; returns its offset."""
        offset = self.end
        self.keys.append(key)
        self.values.append(value)
        self.stamps.append(stamp_ms)
        self.headers.append(headers or ())
        return offset

    def first_stamp(self) -> int | None:
        return self.stamps[self.head] if self.head < len(self.stamps) else None

    def drop_first(self, n: int = 1) -> None:
        """Drop the ``n`` oldest live records (retention)."""
        n = min(n, len(self))
        self.head += n
        self.start += n
        if self.head >= 1024 and 2 * self.head >= len(self.values):
            for col in (self.keys, self.values, self.stamps, self.headers):
                del col[: self.head]
            self.head = 0

    def read(self, offset: int, limit: int) -> list[Record]:
        i = self.head + max(offset, self.start) - self.start
        j = min(i + limit, len(self.values))
        t, p, base = self.topic, self.index, self.start - self.head
        keys, values, stamps, headers = self.keys, self.values, self.stamps, self.headers
        return [Record(t, p, base + k, keys[k], values[k], stamps[k], headers[k]) for k in range(i, j)]

    def offset_for_time(self, ts_ms: int) -> int:
        """First offset whose timestamp is >= ``ts_ms`` (timestamps are non-decreasing), else end."""
        return self.start + bisect.bisect_left(self.stamps, ts_ms, lo=self.head) - self.head


@dataclass
class TopicLog:
    name: str
    partitions: list[PartitionLog]
    retention_ms: int | None
    rr: itertools.count = field(default_factory=itertools.count)
