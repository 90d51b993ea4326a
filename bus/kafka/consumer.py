"""The Kafka consumer of :class:`~bus.kafka.KafkaBus`: one ``AIOKafkaConsumer`` behind the
:class:`~bus.base.Consumer` interface.

With a ``group_id`` it subscribes (classic group protocol, aiokafka's round-robin assignor, eager
rebalances; the rebalance callbacks are awaited from aiokafka's coordinator task) and ``start``
returns once the first assignment is known; partitions without a committed offset start from
``start_from``. Without one it assigns every partition and seeks to the beginning, the end or
``offsets_for_times``. Offsets are committed only by :meth:`KafkaConsumer.commit`
(``enable_auto_commit=False``). Every aiokafka error that reaches a caller is a
:class:`~bus.base.BusError`; a cancelled ``getmany`` loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka import TopicPartition as KTP
from aiokafka.errors import IllegalStateError, KafkaError

from bus.base import (
    BusError,
    Consumer,
    RebalanceCallback,
    Record,
    StartFrom,
    TopicPartition,
    call_rebalance_callback,
    checked_consumer_args,
)
from bus.kafka.outage import throttle_metadata_refresh


class KafkaBus(Protocol):
    """What a consumer needs of its bus (``bus.kafka.KafkaBus`` implements it): the connection
    settings, topic creation, the started check every call makes, and being forgotten when it stops."""

    bootstrap: str
    client_id: str
    connect_timeout_s: float
    request_timeout_ms: int
    session_timeout_ms: int
    heartbeat_interval_ms: int
    fetch_max_wait_ms: int
    assignment_timeout_s: float
    client_kwargs: dict[str, Any]  # TLS/SASL options (bus.kafka.security), for every client

    async def _ensure_exists(self, topic: str) -> list[int]: ...

    def _check_started(self) -> None: ...

    def _forget(self, consumer: KafkaConsumer) -> None: ...

log = logging.getLogger(__name__)


def _ktp(tp: TopicPartition) -> KTP:
    return KTP(tp.topic, tp.partition)


def _tp(ktp: KTP) -> TopicPartition:
    return TopicPartition(ktp.topic, ktp.partition)


class _TransientOffsetErrors(logging.Filter):
    """Turns aiokafka's ERROR "Failed fetch offsets ... NotLeaderForPartitionError" into a DEBUG
    line of this module. A consumer that starts right after its topic was created asks the broker
    for the partition's end offset while the broker is still taking up leadership (the metadata
    already names it: ``ensure_topics`` waits for that); aiokafka retries and succeeds a moment
    later, so the line said "error" about nothing. Other offset failures stay errors."""

    TRANSIENT = ("NotLeaderForPartitionError", "LeaderNotAvailableError")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and isinstance(record.msg, str) \
                and record.msg.startswith("Failed fetch offsets"):
            text = record.getMessage()
            if any(t in text for t in self.TRANSIENT):
                log.debug("retrying: %s", text)
                return False
        return True


logging.getLogger("aiokafka.consumer.fetcher").addFilter(_TransientOffsetErrors())



class _Listener(ConsumerRebalanceListener):
    def __init__(self, owner: KafkaConsumer) -> None:
        self.owner = owner

    async def on_partitions_revoked(self, revoked: Iterable[KTP]) -> None:
        await call_rebalance_callback(self.owner._on_revoked, {_tp(k) for k in revoked}, "on_revoked", log)

    async def on_partitions_assigned(self, assigned: Iterable[KTP]) -> None:
        tps = {_tp(k) for k in assigned}
        await self.owner._seek_uncommitted_to_time(tps)
        await call_rebalance_callback(self.owner._on_assigned, tps, "on_assigned", log)


class KafkaConsumer(Consumer):
    """One aiokafka consumer; see the module docstring. Owned by one task (one ``getmany`` caller)."""

    def __init__(
        self,
        bus: KafkaBus,
        topics: Sequence[str],
        group_id: str | None,
        start_from: StartFrom,
        on_assigned: RebalanceCallback | None,
        on_revoked: RebalanceCallback | None,
    ) -> None:
        self._bus = bus
        self.topics = sorted(set(checked_consumer_args(topics, start_from)))
        self.group_id = group_id
        self._start_from = start_from
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._consumer: AIOKafkaConsumer | None = None
        self._state = "new"

    async def start(self) -> None:
        if self._state == "started":
            return
        if self._state == "stopped":
            raise BusError("a stopped consumer cannot be restarted; create a new one")
        self._bus._check_started()
        b = self._bus
        reset = "latest" if self._start_from == "latest" else "earliest"
        consumer = AIOKafkaConsumer(
            bootstrap_servers=b.bootstrap,
            client_id=b.client_id,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset=reset,
            request_timeout_ms=b.request_timeout_ms,
            session_timeout_ms=b.session_timeout_ms,
            heartbeat_interval_ms=b.heartbeat_interval_ms,
            fetch_max_wait_ms=b.fetch_max_wait_ms,
            retry_backoff_ms=100,
            **b.client_kwargs,
        )
        throttle_metadata_refresh(consumer._client)
        self._consumer = consumer
        try:
            if self.group_id is not None:
                for t in self.topics:  # create missing topics with our default partitions, not the broker's
                    await b._ensure_exists(t)
                consumer.subscribe(self.topics, listener=_Listener(self))
                await asyncio.wait_for(consumer.start(), b.assignment_timeout_s)
            else:
                tps = [KTP(t, p) for t in self.topics for p in await b._ensure_exists(t)]
                await asyncio.wait_for(consumer.start(), b.connect_timeout_s)
                consumer.assign(tps)
                await self._seek_groupless(tps)
        except BaseException as exc:
            await consumer.stop()
            self._consumer = None
            self._state = "stopped"
            if isinstance(exc, (KafkaError, TimeoutError)):
                raise BusError(f"consumer of {self.topics} on {b.bootstrap} failed to start: {exc!r}") from exc
            raise
        self._state = "started"

    async def _seek_groupless(self, tps: list[KTP]) -> None:
        c = self._consumer
        assert c is not None
        if self._start_from == "earliest":
            await c.seek_to_beginning(*tps)
        elif self._start_from == "latest":
            await c.seek_to_end(*tps)
        else:
            found = await c.offsets_for_times({tp: int(self._start_from) for tp in tps})
            past_end = [tp for tp in tps if found.get(tp) is None]
            for tp in tps:
                if found.get(tp) is not None:
                    c.seek(tp, found[tp].offset)
            if past_end:
                await c.seek_to_end(*past_end)
        for tp in tps:  # resolve lazily-reset positions now, so "latest" means "when start returned"
            await c.position(tp)

    async def _seek_uncommitted_to_time(self, tps: set[TopicPartition]) -> None:
        """Group member starting from a timestamp: partitions without a committed offset seek there."""
        c = self._consumer
        if c is None or isinstance(self._start_from, str) or not tps:
            return
        uncommitted = [_ktp(tp) for tp in sorted(tps) if await c.committed(_ktp(tp)) is None]
        if not uncommitted:
            return
        found = await c.offsets_for_times({tp: int(self._start_from) for tp in uncommitted})
        for tp in uncommitted:
            if found.get(tp) is not None:
                c.seek(tp, found[tp].offset)
            else:
                await c.seek_to_end(tp)

    async def stop(self) -> None:
        self._state = "stopped"
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await consumer.stop()  # leaves the group: its partitions move on at once
        self._bus._forget(self)

    def _live(self) -> AIOKafkaConsumer:
        if self._state != "started" or self._consumer is None:
            raise BusError(f"consumer is {self._state}, not started")
        return self._consumer

    async def getmany(self, timeout_ms: int = 100, max_records: int | None = None) -> list[Record]:
        c = self._live()
        if max_records is not None and max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        try:
            batches = await c.getmany(timeout_ms=max(timeout_ms, 0), max_records=max_records)
        except KafkaError as exc:
            raise BusError(f"getmany on {self.topics} failed: {exc!r}") from exc
        out: list[Record] = []
        for ktp, msgs in batches.items():
            for m in msgs:
                headers = tuple((k, bytes(v) if v is not None else b"") for k, v in (m.headers or ()))
                out.append(Record(ktp.topic, ktp.partition, m.offset, m.key, m.value or b"", m.timestamp, headers))
        return out

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        c = self._live()
        if self.group_id is None:
            raise BusError("commit needs a consumer group: this consumer was created without group_id")
        mine = c.assignment()
        for tp in offsets:
            if _ktp(tp) not in mine:
                raise BusError(f"commit failed: {tp.topic}[{tp.partition}] is not assigned to this member (rebalanced)")
        try:
            await c.commit({_ktp(tp): off for tp, off in offsets.items()})
        except KafkaError as exc:
            raise BusError(f"commit failed (group {self.group_id}): {exc!r}") from exc

    def pause(self, *partitions: TopicPartition) -> None:
        c = self._live()
        mine = c.assignment()
        for tp in partitions:
            if _ktp(tp) not in mine:
                raise BusError(f"cannot pause {tp.topic}[{tp.partition}]: not assigned to this consumer")
        c.pause(*(_ktp(tp) for tp in partitions))

    def resume(self, *partitions: TopicPartition) -> None:
        c = self._live()
        mine = c.assignment()
        c.resume(*(_ktp(tp) for tp in partitions if _ktp(tp) in mine))

    def paused(self) -> set[TopicPartition]:
        return {_tp(k) for k in self._consumer.paused()} if self._consumer is not None else set()

    async def lag(self) -> dict[TopicPartition, int]:
        c = self._live()
        tps = list(c.assignment())
        if not tps:
            return {}
        try:
            ends = await c.end_offsets(tps)
            return {_tp(k): max(0, ends[k] - await c.position(k)) for k in tps}
        except IllegalStateError:  # a rebalance took a partition meanwhile: ask again next time
            return {}
        except KafkaError as exc:
            raise BusError(f"lag of {self.topics} failed: {exc!r}") from exc

    def assignment(self) -> set[TopicPartition]:
        return {_tp(k) for k in self._consumer.assignment()} if self._consumer is not None else set()
