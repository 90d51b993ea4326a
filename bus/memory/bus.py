"""In-process bus with Kafka's semantics: the embedded ``make serve`` mode and fast tests.

One :class:`MemoryBroker` holds the topics, their partitions (append-only logs) and the consumer
groups. A :class:`MemoryBus` is a connection to a broker: ``memory://`` gets a private broker,
``memory://<name>`` a named one shared by every bus of this process that uses the same name (so an
edge and a worker in one process talk through it as they would through Kafka).

Semantics kept (the conformance suite checks them against Kafka too):

* Keyed records go to ``murmur2(key) % partitions``, the Java client's default partitioner, so a
  key lands on the same partition number on both implementations; unkeyed records round-robin.
* Consumer groups: the broker-side :class:`_Group` assigns each topic's partitions to the live
  members subscribed to it (range assignor, members in join order). Every join or leave is an
  eager rebalance run by the joining/leaving task, as aiokafka's coordinator does it: every member's
  ``on_revoked(its partitions)`` first (commits still accepted there), then the new assignment, then
  every ``on_assigned(its new partitions)``; both are called on every rebalance, possibly with an
  empty set. Positions restart from the group's committed offsets (else ``start_from``) and the
  paused set is cleared. Records not committed when a member leaves are read again by the member
  that receives the partition. Callbacks run in the task that joined/left; an exception in one is
  logged, not raised.
* Committed offsets live in the broker, per group, and survive every consumer.
* Topics that do not exist are created on first use (send or subscribe) with ``default_partitions``,
  like a broker with ``auto.create.topics.enable=true``.

Bounded memory: each partition keeps at most ``max_records_per_partition`` records (default
100,000); older ones are dropped from the head, as Kafka's size retention does. Topics with a
``retention_ms`` (from :class:`TopicSpec`, else the bus default; ``None``/``-1`` = no age limit)
also drop records older than that, checked on append. A consumer whose position fell below the
head continues from the head (``auto.offset.reset=earliest``).

Concurrency: everything runs on one event loop, no threads, no locks needed; the broker itself holds
no loop-bound objects, so a named broker may outlive an event loop (tests). Consumers wait on an
``asyncio.Event`` set by ``send``/rebalances: ``getmany`` wakes as soon as a record arrives.
Cancelling ``getmany`` loses nothing: positions advance only in the synchronous step that returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence

from bus.base import (
    Bus,
    BusError,
    Consumer,
    RebalanceCallback,
    Record,
    RecordMetadata,
    StartFrom,
    TopicPartition,
    TopicSpec,
    UnknownTopicError,
    call_rebalance_callback,
    check_partition_arg,
    checked_consumer_args,
    checked_topic_names,
)
from bus.memory.broker import (  # noqa: F401 - re-exported
    DEFAULT_MAX_RECORDS_PER_PARTITION,
    MemoryBroker,
    forget_named,
    named_broker,
)
from bus.partitioner import murmur2, partition_for_key  # noqa: F401 - re-exported
from bus.topics import validate_topic

log = logging.getLogger(__name__)

GETMANY_BATCH_LIMIT = 1000  # records per getmany when the caller gives no max_records


class MemoryConsumer(Consumer):
    """A group member or group-less reader on a :class:`MemoryBroker`. See the module docstring."""

    def __init__(
        self,
        bus: MemoryBus,
        topics: Sequence[str],
        group_id: str | None,
        start_from: StartFrom,
        on_assigned: RebalanceCallback | None,
        on_revoked: RebalanceCallback | None,
    ) -> None:
        self._bus = bus
        self.topics = frozenset(checked_consumer_args(topics, start_from))
        self.group_id = group_id
        self._start_from = start_from
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._event: asyncio.Event | None = None
        self._positions: dict[TopicPartition, int] = {}
        self._paused: set[TopicPartition] = set()
        self._rr = 0
        self._state = "new"  # new -> started -> stopped

    # Consumers are used as dict keys by the group: identity semantics.
    __hash__ = object.__hash__

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()

    @property
    def _broker(self) -> MemoryBroker:
        return self._bus.broker

    async def start(self) -> None:
        if self._state == "started":
            return
        if self._state == "stopped":
            raise BusError("a stopped consumer cannot be restarted; create a new one")
        if not self._bus.started:
            raise BusError(f"{self._bus.url}: bus is not started")
        self._event = asyncio.Event()
        self._state = "started"
        broker = self._broker
        for t in self.topics:
            broker.topic(t)
            broker.listeners.setdefault(t, set()).add(self)
        if self.group_id is None:
            for t in sorted(self.topics):
                for p in range(len(broker.topics[t].partitions)):
                    tp = TopicPartition(t, p)
                    self._positions[tp] = self._reset_position(tp)
        else:
            group = broker.group(self.group_id)
            group.members.append(self)
            await group.rebalance(broker)

    async def stop(self) -> None:
        if self._state != "started":
            self._state = "stopped"
            self._bus._forget(self)
            return
        self._state = "stopped"
        broker = self._broker
        for t in self.topics:
            broker.listeners.get(t, set()).discard(self)
        if self.group_id is not None:
            group = broker.group(self.group_id)
            if self in group.members:
                group.members.remove(self)
                group.assignment.pop(self, None)
                await group.rebalance(broker)
        self._positions.clear()
        self._paused.clear()
        self._wake()
        self._bus._forget(self)

    def _reset_position(self, tp: TopicPartition) -> int:
        part = self._broker.topics[tp.topic].partitions[tp.partition]
        if self._start_from == "earliest":
            return part.start
        if self._start_from == "latest":
            return part.end
        return part.offset_for_time(int(self._start_from))

    async def _revoke(self) -> None:
        """Rebalance phase 1 (called by the group): hand back every partition."""
        await call_rebalance_callback(self._on_revoked, set(self._positions), "on_revoked", log)
        self._positions = {}
        self._paused.clear()

    def _set_assignment(self, tps: frozenset[TopicPartition], committed: Mapping[TopicPartition, int]) -> None:
        """Rebalance phase 2: positions restart from the committed offsets (else ``start_from``)."""
        self._paused.clear()
        self._positions = {}
        for tp in sorted(tps):
            offset = committed.get(tp)
            self._positions[tp] = offset if offset is not None else self._reset_position(tp)
        self._wake()

    async def _notify_assigned(self) -> None:
        """Rebalance phase 3."""
        await call_rebalance_callback(self._on_assigned, set(self._positions), "on_assigned", log)

    def _check_started(self) -> None:
        if self._state != "started":
            raise BusError(f"consumer is {self._state}, not started")

    async def getmany(self, timeout_ms: int = 100, max_records: int | None = None) -> list[Record]:
        self._check_started()
        if max_records is not None and max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        limit = max_records or GETMANY_BATCH_LIMIT
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_ms, 0) / 1000
        assert self._event is not None
        while True:
            self._check_started()  # stop() from another task wakes us: raise instead of waiting on
            self._event.clear()
            out = self._take(limit)
            if out:
                return out
            remaining = deadline - loop.time()
            if remaining <= 0:
                return []
            # Neither wait_for nor asyncio.timeout: on 3.11 wait_for can swallow a cancellation that
            # arrives as the wait completes, and asyncio.timeout can leave a stray cancellation
            # pending when the wait completes as the timer fires. asyncio.wait never cancels or
            # swallows anything: the caller's cancellation propagates as sent.
            waiter = loop.create_task(self._event.wait())
            try:
                await asyncio.wait((waiter,), timeout=remaining)
            finally:
                waiter.cancel()

    def _take(self, limit: int) -> list[Record]:
        """Read up to ``limit`` records, round-robin over partitions; advances positions (sync)."""
        tps = [tp for tp in self._positions if tp not in self._paused]
        if not tps:
            return []
        self._rr = (self._rr + 1) % len(tps)
        out: list[Record] = []
        for tp in tps[self._rr :] + tps[: self._rr]:
            if len(out) >= limit:
                break
            topic = self._broker.topics.get(tp.topic)
            if topic is None:  # deleted under us (delete_topics): nothing more to read there
                continue
            part = topic.partitions[tp.partition]
            pos = max(self._positions[tp], part.start)
            recs = part.read(pos, limit - len(out))
            if recs:
                out.extend(recs)
                self._positions[tp] = recs[-1].offset + 1
        return out

    async def lag(self) -> dict[TopicPartition, int]:
        self._check_started()
        out: dict[TopicPartition, int] = {}
        for tp, pos in self._positions.items():
            topic = self._broker.topics.get(tp.topic)
            if topic is not None:
                part = topic.partitions[tp.partition]
                out[tp] = max(0, part.end - max(pos, part.start))
        return out

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        self._check_started()
        if self.group_id is None:
            raise BusError("commit needs a consumer group: this consumer was created without group_id")
        group = self._broker.group(self.group_id)
        mine = group.assignment.get(self, frozenset())
        for tp, offset in offsets.items():
            if tp not in mine:
                raise BusError(f"commit failed: {tp.topic}[{tp.partition}] is not assigned to this member (rebalanced)")
            topic = self._broker.topics.get(tp.topic)
            if topic is None:
                raise BusError(f"commit failed: topic {tp.topic} was deleted")
            end = topic.partitions[tp.partition].end
            if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= end:
                raise ValueError(f"commit offset for {tp.topic}[{tp.partition}] must be in [0, {end}], got {offset!r}")
        for tp, offset in offsets.items():
            group.committed[tp] = offset

    def pause(self, *partitions: TopicPartition) -> None:
        self._check_started()
        for tp in partitions:
            if tp not in self._positions:
                raise BusError(f"cannot pause {tp.topic}[{tp.partition}]: not assigned to this consumer")
        self._paused.update(partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        self._paused.difference_update(partitions)
        self._wake()

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def assignment(self) -> set[TopicPartition]:
        return set(self._positions)


class MemoryBus(Bus):
    """A connection to a :class:`MemoryBroker`. Owns the consumers it creates: ``stop`` stops them."""

    def __init__(self, url: str = "memory://", broker: MemoryBroker | None = None) -> None:
        self.url = url
        self.broker = broker if broker is not None else MemoryBroker()
        self.started = False
        self._consumers: list[MemoryConsumer] = []

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        if not self.started:
            return
        self.started = False
        for consumer in list(self._consumers):
            await consumer.stop()
        self._consumers.clear()

    def _forget(self, consumer: MemoryConsumer) -> None:
        if consumer in self._consumers:
            self._consumers.remove(consumer)

    def _check_started(self) -> None:
        if not self.started:
            raise BusError(f"{self.url}: bus is not started")

    async def send(
        self,
        topic: str,
        value: bytes,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
        partition: int | None = None,
    ) -> RecordMetadata:
        self._check_started()
        check_partition_arg(partition)
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"value must be bytes, got {type(value).__name__}")
        if key is not None and not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"key must be bytes or None, got {type(key).__name__}")
        if topic not in self.broker.topics:  # existing topics were validated when created
            validate_topic(topic)
        return self.broker.append(topic, bytes(value), None if key is None else bytes(key), tuple(headers), partition)

    async def ensure_topics(self, specs: Iterable[TopicSpec]) -> list[str]:
        self._check_started()
        return [s.name for s in specs if self.broker.create(s)]

    async def list_topics(self, prefix: str = "") -> list[str]:
        self._check_started()
        return sorted(n for n in self.broker.topics if n.startswith(prefix) and not n.startswith("__"))

    async def delete_topics(self, names: Iterable[str]) -> list[str]:
        self._check_started()
        names = checked_topic_names(names)
        return [n for n in names if self.broker.delete(n)]

    async def partitions_for(self, topic: str) -> list[int]:
        self._check_started()
        t = self.broker.topics.get(topic)
        if t is None:
            raise UnknownTopicError(f"{self.url}: unknown topic {topic!r}")
        return list(range(len(t.partitions)))

    async def read_partition(self, topic: str, partition: int, since_ms: int, limit: int = 100_000,
                             timeout_s: float = 10.0) -> list[Record]:  # noqa: ARG002 - never waits
        self._check_started()
        t = self.broker.topics.get(topic)
        if t is None:
            raise UnknownTopicError(f"{self.url}: unknown topic {topic!r}")
        if not 0 <= partition < len(t.partitions):
            raise ValueError(f"topic {topic!r} has no partition {partition}")
        log = t.partitions[partition]
        start = log.offset_for_time(since_ms)
        return log.read(start, min(limit, log.end - start))

    def consumer(
        self,
        topics: Sequence[str],
        group_id: str | None = None,
        start_from: StartFrom = "latest",
        on_assigned: RebalanceCallback | None = None,
        on_revoked: RebalanceCallback | None = None,
    ) -> MemoryConsumer:
        c = MemoryConsumer(self, topics, group_id, start_from, on_assigned, on_revoked)
        self._consumers.append(c)
        return c
