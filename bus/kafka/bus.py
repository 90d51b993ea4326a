"""Apache Kafka implementation of :class:`~bus.base.Bus` with aiokafka.

* One shared ``AIOKafkaProducer`` per bus: idempotent, ``acks="all"``, ``linger_ms`` 0 by default:
  aiokafka keeps one produce request in flight per partition, so records arriving meanwhile batch
  on their own, and a linger only adds its own length to every record's latency (docs/bus.md,
  Semantics; figures in docs/benchmarks.md, Bus).
  Set ``?linger_ms=N`` for bulk producers. Keys are caller bytes (request ids), so aiokafka's default
  partitioner (murmur2, like the Java client and the memory bus) keeps a request's records on one
  partition, in order.
* Consumers (:mod:`bus.kafka.consumer`): ``enable_auto_commit=False``, offsets committed only by
  ``commit``; group members ``subscribe``, group-less consumers ``assign`` and seek.
* An ``AIOKafkaAdminClient`` creates and deletes topics (``TOPIC_ALREADY_EXISTS`` and
  ``UNKNOWN_TOPIC_OR_PARTITION`` count as success) and reads one topic's partitions without
  auto-creating it.
* Broker unreachable: :meth:`KafkaBus.start` retries with exponential backoff (0.1 s doubling to 2
  s; :mod:`bus.kafka.connect`) and raises :class:`BusError` naming the bootstrap address once
  ``connect_timeout_s`` (default 15) has passed; every start attempt is itself bounded by what is
  left, so it never hangs.
  Broker gone after start: each client's metadata refresh backs off and aiokafka's repeated log
  lines are limited (:mod:`bus.kafka.outage`); sends wait and retry as aiokafka does.

Every aiokafka error that reaches a caller is re-raised as :class:`BusError`. Cancellation: a
cancelled ``getmany`` loses nothing (aiokafka hands records over only when it returns); a cancelled
``start`` closes whatever it had opened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
    for_code,
)
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.protocol.offset import OffsetRequest

from bus.base import (
    Bus,
    BusError,
    RebalanceCallback,
    Record,
    RecordMetadata,
    StartFrom,
    TopicSpec,
    UnknownTopicError,
    check_partition_arg,
    checked_topic_names,
)
from bus.kafka.connect import retrying
from bus.kafka.consumer import KafkaConsumer
from bus.kafka.metadata import TopicNotReady, led_partitions
from bus.kafka.outage import limit_repeated_logs, throttle_metadata_refresh
from bus.kafka.reader import PartitionReader
from bus.kafka.security import KafkaSecurity
from bus.topics import validate_topic

log = logging.getLogger(__name__)


def _topic_configs(s: TopicSpec) -> dict[str, str]:
    """The topic-level configs a spec asks for: ``retention.ms``, and compaction (``compact,delete``:
    the newest record per key is kept, and records past retention still go)."""
    out = {"retention.ms": str(s.retention_ms)} if s.retention_ms is not None else {}
    if s.compact:
        out["cleanup.policy"] = "compact,delete"
    return out

class KafkaBus(Bus):
    """A connection to a Kafka cluster; see the module docstring. Owns its producer, admin client
    and every consumer it created (``stop`` stops them all). ``stop`` is idempotent."""

    def __init__(
        self,
        bootstrap: str,
        *,
        url: str | None = None,
        client_id: str = "lockgate",
        connect_timeout_s: float = 15.0,
        request_timeout_ms: int = 30_000,
        linger_ms: int = 0,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int = 500,
        fetch_max_wait_ms: int = 500,
        assignment_timeout_s: float = 60.0,
        default_partitions: int = 1,
        max_request_size: int = 1 << 20,
        security: KafkaSecurity | None = None,
    ) -> None:
        if connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
        if default_partitions < 1:
            raise ValueError(f"default_partitions must be >= 1, got {default_partitions}")
        self.bootstrap = bootstrap
        self.url = url or f"kafka://{bootstrap}"
        self.client_id = client_id
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_ms = request_timeout_ms
        self.linger_ms = linger_ms
        self.session_timeout_ms = session_timeout_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.assignment_timeout_s = assignment_timeout_s
        self.default_partitions = default_partitions
        self.max_request_size = max_request_size  # the producer's max.request.size: larger records are refused
        self.security = security or KafkaSecurity()
        # Built once (the TLS context reads its files here, so a bad CA file fails at connect) and
        # passed to every client this bus creates: producer, admin, consumers, partition reader.
        self.client_kwargs: dict[str, Any] = self.security.client_kwargs()
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._consumers: list[KafkaConsumer] = []
        # read_partition's standing group-less reader: connected on the first read (or by
        # prepare_reads), kept until stop (bus/kafka/reader.py)
        self._reader = PartitionReader(bootstrap, client_id, request_timeout_ms, self.client_kwargs, self.url)

    async def start(self) -> None:
        if self._producer is not None:
            return
        limit_repeated_logs()  # during a broker outage aiokafka repeats its ERRORs many times a second

        async def start_producer() -> AIOKafkaProducer:
            p = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap,
                client_id=self.client_id,
                acks="all",
                enable_idempotence=True,
                linger_ms=self.linger_ms,
                request_timeout_ms=self.request_timeout_ms,
                max_request_size=self.max_request_size,
                **self.client_kwargs,
            )
            throttle_metadata_refresh(p.client)  # its sender spun on refreshes while no broker answered
            try:
                await p.start()
            except BaseException:
                await p.stop()
                raise
            return p

        async def start_admin() -> AIOKafkaAdminClient:
            a = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, client_id=self.client_id,
                                    request_timeout_ms=self.request_timeout_ms, **self.client_kwargs)
            throttle_metadata_refresh(a._client)
            try:
                await a.start()
            except BaseException:
                await a.close()
                raise
            return a

        t0 = time.monotonic()
        producer = await retrying("bus start", self.bootstrap, self.connect_timeout_s, start_producer)
        try:
            left = max(self.connect_timeout_s - (time.monotonic() - t0), 1.0)
            self._admin = await retrying("bus start (admin)", self.bootstrap, left, start_admin)
        except BaseException:
            await producer.stop()
            raise
        self._producer = producer

    async def stop(self) -> None:
        for c in list(self._consumers):
            await c.stop()
        await self._reader.stop()
        producer, self._producer = self._producer, None
        admin, self._admin = self._admin, None
        if producer is not None:
            await producer.stop()  # flushes what is pending
        if admin is not None:
            await admin.close()

    def _forget(self, consumer: KafkaConsumer) -> None:
        if consumer in self._consumers:
            self._consumers.remove(consumer)

    def _check_started(self) -> None:
        if self._producer is None:
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
        assert self._producer is not None
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"value must be bytes, got {type(value).__name__}")
        if key is not None and not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"key must be bytes or None, got {type(key).__name__}")
        validate_topic(topic)
        check_partition_arg(partition)
        try:
            md = await self._producer.send_and_wait(topic, value, key=key, partition=partition,
                                                    headers=list(headers) or None)
        except KafkaError as exc:
            raise BusError(f"send to {topic} on {self.bootstrap} failed: {exc!r}") from exc
        except AssertionError:  # aiokafka asserts that an explicit partition is in the topic's metadata
            raise ValueError(f"topic {topic} has no partition {partition}") from None
        ts = md.timestamp if md.timestamp is not None and md.timestamp >= 0 else int(time.time() * 1000)
        return RecordMetadata(md.topic, md.partition, md.offset, ts)

    async def ensure_topics(self, specs: Iterable[TopicSpec]) -> list[str]:
        self._check_started()
        assert self._admin is not None
        specs = list(specs)
        for s in specs:
            validate_topic(s.name)
            if s.partitions < 1 or s.replication < 1:
                raise ValueError(f"topic {s.name}: partitions and replication must be >= 1")
        if not specs:
            return []
        new = [NewTopic(s.name, s.partitions, s.replication, topic_configs=_topic_configs(s) or None) for s in specs]
        try:
            resp = await self._admin.create_topics(new)
        except KafkaError as exc:
            raise BusError(f"create topics on {self.bootstrap} failed: {exc!r}") from exc
        created = []
        for item in resp.topic_errors:
            topic, code = item[0], item[1]
            if code == 0:
                created.append(topic)
            elif for_code(code) is not TopicAlreadyExistsError:
                msg = item[2] if len(item) > 2 else ""
                raise BusError(f"cannot create topic {topic}: {for_code(code).__name__} {msg}".rstrip())
        for name in created:  # wait until they are usable, so a send right after does not race
            await self._describe(name, wait=True)
            await self._wait_leading(name)
        return created

    async def _wait_leading(self, topic: str) -> None:
        """Wait until each partition's leader answers a ListOffsets for it. A KRaft broker publishes
        a new topic's metadata (a leader named) a moment before its replica manager takes that
        leadership up; a produce in between is refused with NotLeaderForPartition, which aiokafka
        retries and logs as a WARNING (33 of them for 10 fresh 6-partition topics sent to at once,
        before this). Best effort: an error or the request timeout ends the wait, and sends retry
        anyway. The request goes through the admin client's private ``_send_request``, as above."""
        assert self._admin is not None
        deadline = time.monotonic() + self.request_timeout_ms / 1000
        while time.monotonic() < deadline:
            try:
                meta = await self._topic_metadata(topic)
                by_leader: dict[int, list[int]] = {}
                for p in meta["partitions"] if meta is not None else ():
                    by_leader.setdefault(p["leader"], []).append(p["partition"])
                waiting = 0
                for node, parts in by_leader.items():
                    resp = await self._admin._send_request(OffsetRequest(-1, 0, [(topic, [(p, -1) for p in parts])]), node)
                    waiting += sum(1 for _, answers in resp.topics for a in answers if a[1] != 0)
            except KafkaError as exc:
                log.debug("leadership probe of %s: %r", topic, exc)
                return
            if by_leader and not waiting:
                return
            await asyncio.sleep(0.02)

    async def _topic_metadata(self, topic: str) -> dict[str, Any] | None:
        """Metadata of ``topic`` alone, never auto-creating it. aiokafka's ``list_topics`` asks for
        every topic of the cluster (its answer grows with every topic the broker ever served, all
        of it decoded in pure Python per call; docs/bus.md, Topics), and its
        ``describe_topics`` sends ``allow_auto_topic_creation=True``, which would create the topic on
        a broker with ``auto.create.topics.enable``. So one MetadataRequest names the topic and says
        no; it goes through the admin client's request path (``_send_request``, a private method of
        aiokafka's admin client: there is no public call that takes the flag)."""
        assert self._admin is not None
        resp = await self._admin._send_request(MetadataRequest([topic], allow_auto_topic_creation=False))
        found = [t for t in resp.to_object()["topics"] if t["topic"] == topic]
        return found[0] if found else None

    async def _describe(self, topic: str, wait: bool = False) -> list[int] | None:
        """Partitions of ``topic``, or ``None`` when it does not exist (``UNKNOWN_TOPIC_OR_PARTITION``
        only). Never creates. A partition without a leader raises :class:`TopicNotReady` (a
        transient ``BusError``, :mod:`bus.kafka.metadata`); ``wait``: both a missing topic and a
        leaderless one are asked again (backoff 50 ms doubling to 0.5 s) up to the request timeout."""
        assert self._admin is not None
        deadline = time.monotonic() + self.request_timeout_ms / 1000
        backoff = 0.05
        while True:
            try:
                meta = await self._topic_metadata(topic)
            except KafkaError as exc:
                raise BusError(f"metadata for {topic} on {self.bootstrap} failed: {exc!r}") from exc
            try:
                found = led_partitions(topic, meta)
            except TopicNotReady:
                if not wait or time.monotonic() > deadline:
                    raise
                found = None
            else:
                if found is not None or not wait or time.monotonic() > deadline:
                    return found
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.5)

    async def _ensure_exists(self, topic: str) -> list[int]:
        try:
            parts = await self._describe(topic)
        except TopicNotReady:  # there, electing a leader: wait for it (raises if it takes too long)
            parts = await self._describe(topic, wait=True)
        if parts is None:
            await self.ensure_topics([TopicSpec(topic, self.default_partitions)])
            parts = await self._describe(topic, wait=True)
        if parts is None:
            raise BusError(f"topic {topic} on {self.bootstrap} did not become available")
        return parts

    async def list_topics(self, prefix: str = "") -> list[str]:
        self._check_started()
        assert self._admin is not None
        try:
            names = await self._admin.list_topics()  # the whole cluster's metadata: an admin call
        except KafkaError as exc:
            raise BusError(f"list topics on {self.bootstrap} failed: {exc!r}") from exc
        return sorted(n for n in names if n.startswith(prefix) and not n.startswith("__"))

    async def delete_topics(self, names: Iterable[str]) -> list[str]:
        self._check_started()
        assert self._admin is not None
        names = checked_topic_names(names)
        if not names:
            return []
        # Untracked before the request too: a metadata refresh that starts while the broker deletes
        # would otherwise ask for them and log the ERROR once (seen in a benchmark's clean-up). A
        # send to one of them in between tracks it again, and the line below drops it once more.
        self._untrack(names)
        try:
            resp = await self._admin.delete_topics(names)
        except KafkaError as exc:
            raise BusError(f"delete topics on {self.bootstrap} failed: {exc!r}") from exc
        deleted, failed = [], []
        for topic, code in resp.topic_error_codes:
            if code == 0:
                deleted.append(topic)
            elif for_code(code) is not UnknownTopicOrPartitionError:
                failed.append(f"{topic}: {for_code(code).__name__}")
        self._untrack(deleted)
        if failed:
            raise BusError(f"delete topics on {self.bootstrap} failed: {'; '.join(failed)}")
        return [n for n in names if n in deleted]

    def _untrack(self, topics: Iterable[str]) -> None:
        """Stop the producer's metadata refreshes asking for deleted topics. aiokafka's client keeps
        every topic it ever sent to in a private set and, once one is gone, logs an ERROR "Topic ...
        not found in cluster metadata" at every refresh. Its public ``set_topics`` cannot shrink the
        set to empty (empty means "every topic of the cluster"), so the names are discarded from the
        set itself; if aiokafka renames it, this does nothing (and the Kafka tests notice)."""
        tracked = getattr(getattr(self._producer, "client", None), "_topics", None)
        if isinstance(tracked, set):
            tracked.difference_update(topics)

    async def partitions_for(self, topic: str) -> list[int]:
        self._check_started()
        parts = await self._describe(topic)
        if parts is None:
            # Known to be missing: the producer stops asking for it at every metadata refresh (a
            # send to it had it tracked; aiokafka then logs an ERROR per refresh).
            self._untrack([topic])
            raise UnknownTopicError(f"{self.url}: unknown topic {topic!r}")
        return parts

    async def read_partition(self, topic: str, partition: int, since_ms: int, limit: int = 100_000,
                             timeout_s: float = 10.0) -> list[Record]:
        self._check_started()
        validate_topic(topic)
        check_partition_arg(partition)
        return await self._reader.read(topic, partition, since_ms, limit, timeout_s)

    async def prepare_reads(self, topics: Iterable[str]) -> None:
        self._check_started()
        await self._reader.prepare(checked_topic_names(topics))

    def consumer(
        self,
        topics: Sequence[str],
        group_id: str | None = None,
        start_from: StartFrom = "latest",
        on_assigned: RebalanceCallback | None = None,
        on_revoked: RebalanceCallback | None = None,
    ) -> KafkaConsumer:
        c = KafkaConsumer(self, topics, group_id, start_from, on_assigned, on_revoked)
        self._consumers.append(c)
        return c
