"""The memory bus's broker: topics (append, retention), consumer groups and their rebalances,
committed offsets, and the process-wide named brokers. Semantics: :mod:`bus.memory`.

Holds no loop-bound objects (a named broker may outlive an event loop); everything is called from
one event loop at a time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

from bus.base import RecordMetadata, TopicPartition, TopicSpec
from bus.memory.log import PartitionLog, TopicLog
from bus.partitioner import partition_for_key
from bus.topics import validate_topic


class MemoryConsumer(Protocol):
    """What the broker needs of a consumer in one of its groups (``bus.memory.MemoryConsumer``
    implements it): its subscription, the rebalance steps, and a wake-up when records arrive."""

    topics: frozenset[str]

    async def _revoke(self) -> None: ...

    def _set_assignment(self, tps: frozenset[TopicPartition], committed: Mapping[TopicPartition, int]) -> None: ...

    async def _notify_assigned(self) -> None: ...

    def _wake(self) -> None: ...

DEFAULT_MAX_RECORDS_PER_PARTITION = 100_000
PARTITION_CACHE_SIZE = 65_536  # (key, partitions) -> partition memo entries per broker


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Group:
    """Broker-side group coordinator: members, their assignment, committed offsets."""

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        self.members: list[MemoryConsumer] = []
        self.assignment: dict[MemoryConsumer, frozenset[TopicPartition]] = {}
        self.committed: dict[TopicPartition, int] = {}
        self.generation = 0

    async def rebalance(self, broker: MemoryBroker) -> None:
        """Eager rebalance: every member's ``on_revoked`` (its partitions still committable), then
        the new range assignment, then every ``on_assigned``. A join/leave during a callback starts
        a newer generation; this one then stops and leaves the rest to it."""
        self.generation += 1
        gen = self.generation
        for member in list(self.members):
            await member._revoke()
            if self.generation != gen:
                return
        self.assignment = self._assign(broker)
        for member in self.members:
            member._set_assignment(self.assignment.get(member, frozenset()), self.committed)
        for member in list(self.members):
            await member._notify_assigned()
            if self.generation != gen:
                return

    def _assign(self, broker: MemoryBroker) -> dict[MemoryConsumer, frozenset[TopicPartition]]:
        new: dict[MemoryConsumer, set[TopicPartition]] = {m: set() for m in self.members}
        for topic in sorted({t for m in self.members for t in m.topics}):
            subs = [m for m in self.members if topic in m.topics]
            n = len(broker.topic(topic).partitions)
            per, extra = divmod(n, len(subs))
            p = 0
            for i, member in enumerate(subs):  # range assignor, members in join order
                count = per + (1 if i < extra else 0)
                new[member].update(TopicPartition(topic, q) for q in range(p, p + count))
                p += count
        return {m: frozenset(tps) for m, tps in new.items()}


class MemoryBroker:
    """The shared state behind one or more :class:`MemoryBus` connections. Not loop-bound."""

    def __init__(
        self,
        default_partitions: int = 1,
        max_records_per_partition: int = DEFAULT_MAX_RECORDS_PER_PARTITION,
        retention_ms: int | None = None,
    ) -> None:
        if default_partitions < 1:
            raise ValueError(f"default_partitions must be >= 1, got {default_partitions}")
        if max_records_per_partition < 1:
            raise ValueError(f"max_records_per_partition must be >= 1, got {max_records_per_partition}")
        self.default_partitions = default_partitions
        self.max_records_per_partition = max_records_per_partition
        self.retention_ms = retention_ms
        self.topics: dict[str, TopicLog] = {}
        self.groups: dict[str, _Group] = {}
        self.listeners: dict[str, set[MemoryConsumer]] = {}
        self._partition_cache: dict[tuple[bytes, int], int] = {}

    def create(self, spec: TopicSpec) -> bool:
        validate_topic(spec.name)
        if spec.partitions < 1:
            raise ValueError(f"topic {spec.name}: partitions must be >= 1, got {spec.partitions}")
        if spec.name in self.topics:
            return False
        retention = spec.retention_ms if spec.retention_ms is not None else self.retention_ms
        self.topics[spec.name] = TopicLog(spec.name, [PartitionLog(spec.name, i) for i in range(spec.partitions)],
                                        retention)
        return True

    def delete(self, name: str) -> bool:
        """Drop topic ``name`` and its records; ``False`` when there was none. Consumers keep their
        positions on it and read nothing (:meth:`MemoryConsumer._take` skips missing topics);
        committed offsets are dropped with it, as Kafka drops a deleted topic's offsets."""
        if self.topics.pop(name, None) is None:
            return False
        for g in self.groups.values():
            for tp in [tp for tp in g.committed if tp.topic == name]:
                del g.committed[tp]
        return True

    def topic(self, name: str) -> TopicLog:
        """The topic, created with the default partition count when missing (auto-create)."""
        t = self.topics.get(name)
        if t is None:
            self.create(TopicSpec(name, self.default_partitions))
            t = self.topics[name]
        return t

    def append(self, topic: str, value: bytes, key: bytes | None, headers: tuple[tuple[str, bytes], ...],
               partition: int | None = None) -> RecordMetadata:
        t = self.topic(topic)
        n = len(t.partitions)
        if partition is not None:
            if partition >= n:
                raise ValueError(f"topic {topic} has no partition {partition} (it has {n})")
            p = partition
        elif n == 1:
            p = 0
        elif key is not None:
            cached = self._partition_cache.get((key, n))
            if cached is None:
                # A key is usually sent many times (one request id: one record per token), and the
                # pure-Python murmur2 is dear on a per-token path: memoise, bounded by clearing
                # (figure in docs/benchmarks.md, Edge).
                if len(self._partition_cache) >= PARTITION_CACHE_SIZE:
                    self._partition_cache.clear()
                cached = self._partition_cache[(key, n)] = partition_for_key(key, n)
            p = cached
        else:
            p = next(t.rr) % n
        part = t.partitions[p]
        now = _now_ms()
        offset = part.append(key, value, now, headers)
        if len(part) > self.max_records_per_partition:
            part.drop_first(len(part) - self.max_records_per_partition)
        if t.retention_ms is not None and t.retention_ms >= 0:
            horizon = now - t.retention_ms
            while (first := part.first_stamp()) is not None and first < horizon:
                part.drop_first()
        for consumer in self.listeners.get(topic, ()):
            consumer._wake()
        return RecordMetadata(topic, p, offset, now)

    def group(self, group_id: str) -> _Group:
        g = self.groups.get(group_id)
        if g is None:
            g = self.groups[group_id] = _Group(group_id)
        return g


_NAMED: dict[str, MemoryBroker] = {}


def named_broker(name: str, **options: int | None) -> MemoryBroker:
    """The process-wide broker called ``name`` (created on first use with ``options``)."""
    broker = _NAMED.get(name)
    if broker is None:
        broker = _NAMED[name] = MemoryBroker(**options)  # type: ignore[arg-type]  # MemoryBroker's own keywords, checked by it
    return broker


def forget_named(name: str) -> None:
    """Drop a named broker and its records (tests, or an embedded server shutting down for good)."""
    _NAMED.pop(name, None)
