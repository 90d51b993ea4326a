"""Read one partition of a Kafka topic, from a point in time up to its end: a standing, group-less
reader (:class:`PartitionReader`).

Used where a process must learn what a partition already holds: a worker taking over a dead
peer's requests reads the peer's request partition, then the reply partition of each request to
resume it from the tokens already published (docs/worker.md, "Failover"). Both reads lie on the
failover's critical path, so the reader stands: one aiokafka client per bus, started on the first
read (or by :meth:`PartitionReader.prepare`), its connections kept open and the partitions' leaders
cached. A read is then plain requests on an open connection:

1. the partition's leader: cached, else one ``MetadataRequest`` naming the topic alone and
   allowing no auto-creation (a read of a missing topic must not create it);
2. the first offset whose timestamp is at or after ``since_ms``: one ``ListOffsets`` (the broker's
   time index); none: the read is empty;
3. ``Fetch`` requests from there (``max_wait`` 0: the broker answers at once with what it has);
   the first answer's high watermark is the end of the read, so records sent meanwhile are not
   waited for.

Before, every read started a throwaway consumer: a TCP connect, ``ApiVersions``, a metadata
request, ``ListOffsets`` twice, then a fetch whose wait started at 100 ms (figures in
docs/worker.md, "The stall"). Nothing here joins a group, commits or changes a broker setting.

Many reads may run at once: the connection pipelines their requests. A leader that moved
(``NOT_LEADER_OR_FOLLOWER``, ``UNKNOWN_TOPIC_OR_PARTITION`` on the fetch) is looked up again; an
offset below the log start (retention) continues at the log start. A keep-alive task sends a
metadata request naming no topic (brokers only) to every broker read from, every ``KEEPALIVE_S``,
so neither aiokafka's idle timeout (9 min) nor the broker's (``connections.max.idle.ms``, 10 min by
default, often less on managed Kafka) closes the connection a takeover will need.

Concurrency: event loop only. Owns its client and the keep-alive task (:meth:`start` /
:meth:`stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.errors import (
    KafkaError,
    NotLeaderForPartitionError,
    OffsetOutOfRangeError,
    UnknownTopicOrPartitionError,
    for_code,
)
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.protocol.offset import OffsetRequest
from aiokafka.record.memory_records import MemoryRecords

from bus.base import BusError, Record, UnknownTopicError
from bus.kafka.metadata import TopicNotReady, led_partitions
from bus.kafka.outage import throttle_metadata_refresh

log = logging.getLogger(__name__)

KEEPALIVE_S = 60.0
RETRY_S = 0.05  # backoff after a retriable error (a leader moved, an election, a connection lost)
PARTITION_FETCH_BYTES = 1 << 20  # per fetch (the consumer's max.partition.fetch.bytes default)
_LATEST, _EARLIEST = -1, -2  # ListOffsets' special timestamps
_MOVED = (NotLeaderForPartitionError, UnknownTopicOrPartitionError)


class PartitionReader:
    """See the module docstring. ``name``: the bus, for error messages."""

    def __init__(self, bootstrap: str, client_id: str, request_timeout_ms: int,
                 client_kwargs: Mapping[str, Any] | None = None, name: str = "") -> None:
        self.bootstrap = bootstrap
        self.client_id = f"{client_id}-reader"
        self.request_timeout_ms = request_timeout_ms
        self.client_kwargs = dict(client_kwargs or {})
        self.name = name or f"kafka://{bootstrap}"
        self._client: AIOKafkaClient | None = None
        self._starting: asyncio.Lock | None = None
        self._partitions: dict[str, list[int]] = {}
        self._leaders: dict[tuple[str, int], int] = {}
        self._keepalive: asyncio.Task | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> AIOKafkaClient:
        """Connect (once; concurrent callers share the start). Returns the client."""
        if self._client is not None:
            return self._client
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._client is not None:
                return self._client
            # The client's own metadata refresh asks for every topic (it tracks none): it only
            # supplies the broker list here, so it runs rarely; leaders come from lookups below.
            client = AIOKafkaClient(bootstrap_servers=self.bootstrap, client_id=self.client_id,
                                    request_timeout_ms=self.request_timeout_ms, retry_backoff_ms=100,
                                    metadata_max_age_ms=3_600_000, **self.client_kwargs)
            throttle_metadata_refresh(client)
            try:
                await client.bootstrap()  # one connection, ApiVersions, a metadata request naming no topic
            except BaseException:
                await client.close()
                raise
            self._client = client
            self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive(), name=f"{self.client_id}-keepalive")
            return client

    async def stop(self) -> None:
        """Close the connections. Idempotent; a later read starts again."""
        task, self._keepalive = self._keepalive, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        client, self._client = self._client, None
        self._leaders.clear()
        self._partitions.clear()
        if client is not None:
            await client.close()

    async def prepare(self, topics: Iterable[str]) -> None:
        """Connect, look up the leaders of ``topics`` and open a connection to each, so a later
        read of them starts with its ``ListOffsets``. Best effort: a missing topic or a broker
        error is logged and skipped (the read itself raises)."""
        try:
            client = await self.start()
        except (KafkaError, OSError) as exc:
            log.debug("reader: not connected (%r); the first read connects", exc)
            return
        for topic in topics:
            try:
                async with asyncio.timeout(self.request_timeout_ms / 1000):  # a leaderless topic is asked again
                    parts = await self._lookup(client, topic)
                    for node in {self._leaders[(topic, p)] for p in parts}:
                        await client.ready(node)
            except (KafkaError, BusError, OSError, TimeoutError) as exc:
                log.debug("reader: preparing %s failed (%r)", topic, exc)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            client = self._client
            if client is None:
                return
            for node in set(self._leaders.values()):
                try:
                    await client.send(node, MetadataRequest([]))  # brokers only: a few bytes each way
                except KafkaError as exc:
                    log.debug("reader: keep-alive to node %s failed (%r)", node, exc)

    # -- the read ---------------------------------------------------------------------------------

    async def read(self, topic: str, partition: int, since_ms: int, limit: int, timeout_s: float) -> list[Record]:
        """The records of ``topic[partition]`` from the first whose timestamp is at or after
        ``since_ms`` up to the partition's end (the high watermark of the first fetch), at most
        ``limit``, oldest first. Raises :class:`UnknownTopicError` for a missing topic,
        ``ValueError`` for a partition it does not have, :class:`BusError` when the broker cannot
        be read within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._read(topic, partition, since_ms, limit)
        except TimeoutError:
            raise BusError(f"reading {topic}[{partition}] took longer than {timeout_s:g}s") from None
        except KafkaError as exc:  # not retriable
            raise BusError(f"reading {topic}[{partition}] failed: {exc!r}") from exc

    async def _read(self, topic: str, partition: int, since_ms: int, limit: int) -> list[Record]:
        client = await self.start()
        if partition not in self._partitions.get(topic, ()):
            if partition not in await self._lookup(client, topic):
                raise ValueError(f"topic {topic!r} has no partition {partition}")
        position = await self._retrying(client, topic, partition, lambda node: self._offset(client, node, topic,
                                                                                            partition, since_ms))
        out: list[Record] = []
        if position is None:
            return out  # nothing at or after since_ms
        end: int | None = None
        while len(out) < limit and (end is None or position < end):
            highwater, raw = await self._retrying(client, topic, partition,
                                                  lambda node, at=position: self._fetch(client, node, topic, partition, at))
            if highwater is None:  # the offset lies below the log start (retention): go on from there
                start = await self._retrying(client, topic, partition,
                                             lambda node: self._offset(client, node, topic, partition, _EARLIEST))
                if start is None or start <= position:
                    return out
                position = start
                continue
            end = highwater if end is None else end
            position, done = _unpack(raw, topic, partition, position, end, limit, out)
            if done:
                break
        return out

    async def _retrying(self, client: AIOKafkaClient, topic: str, partition: int, request: Any) -> Any:
        """Run ``request(leader)`` until it succeeds or raises something not retriable (the
        caller's timeout bounds it); a moved leader is looked up again."""
        while True:
            node = self._leaders.get((topic, partition))
            if node is None:
                if partition not in await self._lookup(client, topic):
                    raise ValueError(f"topic {topic!r} has no partition {partition}")
                node = self._leaders[(topic, partition)]
            try:
                return await request(node)
            except KafkaError as exc:
                if not getattr(exc, "retriable", False) and not isinstance(exc, _MOVED):
                    raise
                log.debug("reader: %s[%d] on node %s: %r; retrying", topic, partition, node, exc)
                if isinstance(exc, _MOVED) or not client.cluster.broker_metadata(node):
                    self._forget(topic)
            await asyncio.sleep(RETRY_S)

    def _forget(self, topic: str) -> None:
        self._partitions.pop(topic, None)
        for key in [k for k in self._leaders if k[0] == topic]:
            del self._leaders[key]

    async def _lookup(self, client: AIOKafkaClient, topic: str) -> list[int]:
        """The topic's partitions, its leaders cached. Raises :class:`UnknownTopicError` when it
        does not exist; a partition without a leader (an election) is asked again."""
        while True:
            node = client.get_random_node()
            if node is None:
                await client.force_metadata_update()
                node = client.get_random_node()
                if node is None:
                    raise BusError(f"{self.name}: no broker known")
            try:
                resp = await client.send(node, MetadataRequest([topic], allow_auto_topic_creation=False))
                found = [t for t in resp.to_object()["topics"] if t["topic"] == topic]
                parts = led_partitions(topic, found[0] if found else None)
            except TopicNotReady as exc:
                log.debug("reader: %s", exc)
            except KafkaError as exc:
                if not getattr(exc, "retriable", False):
                    raise
                log.debug("reader: metadata of %s from node %s: %r", topic, node, exc)
            else:
                if parts is None:
                    raise UnknownTopicError(f"{self.name}: unknown topic {topic!r}")
                leaders = {p["partition"]: p["leader"] for p in found[0]["partitions"]}
                if any(client.cluster.broker_metadata(n) is None for n in leaders.values()):
                    client.cluster.update_metadata(resp)  # a broker this client has not met: its address
                self._forget(topic)
                self._partitions[topic] = parts
                self._leaders.update({(topic, p): n for p, n in leaders.items()})
                return parts
            await asyncio.sleep(RETRY_S)

    async def _offset(self, client: AIOKafkaClient, node: int, topic: str, partition: int, ts: int) -> int | None:
        """The first offset at or after ``ts`` (or ``_EARLIEST``), None when there is none."""
        resp = await client.send(node, OffsetRequest(-1, 0, [(topic, [(partition, ts)])]))
        for _t, parts in resp.topics:
            for part, code, *info in parts:
                if part != partition:
                    continue
                if code:
                    raise for_code(code)(f"ListOffsets {topic}[{partition}]")
                offset = info[1] if resp.API_VERSION >= 1 else (info[0][0] if info[0] else -1)
                return offset if offset >= 0 else None
        raise BusError(f"ListOffsets for {topic}[{partition}]: no answer for the partition")

    async def _fetch(self, client: AIOKafkaClient, node: int, topic: str, partition: int,
                     position: int) -> tuple[int | None, bytes]:
        """One fetch from ``position``: (high watermark, the raw record batches); (None, b"") when
        the offset is below the log start."""
        req = FetchRequest(0, 1, PARTITION_FETCH_BYTES, 0, [(topic, [(partition, position, PARTITION_FETCH_BYTES)])])
        resp = await client.send(node, req)
        for _t, parts in resp.topics:
            for part, code, highwater, *data in parts:
                if part != partition:
                    continue
                err = for_code(code) if code else None
                if err is OffsetOutOfRangeError:
                    return None, b""
                if err is not None:
                    raise err(f"Fetch {topic}[{partition}]@{position}")
                return highwater, data[-1] or b""
        raise BusError(f"Fetch of {topic}[{partition}]: no answer for the partition")


def _unpack(raw: bytes, topic: str, partition: int, position: int, end: int, limit: int,
            out: list[Record]) -> tuple[int, bool]:
    """Append the records of one fetch's batches from ``position`` below ``end`` to ``out`` (up to
    ``limit``); the next position and whether the read is complete. Control batches (an idempotent
    or transactional producer's markers) are skipped."""
    records = MemoryRecords(raw)
    while records.has_next():
        batch = records.next_batch()
        if batch is None:
            break
        if not batch.validate_crc():
            raise BusError(f"{topic}[{partition}]: record batch at {position} fails its CRC")
        if batch.is_control_batch:
            position = batch.next_offset
            continue
        for rec in batch:
            if rec.offset < position:
                continue  # a compressed batch starting before the position
            if rec.offset >= end:
                return position, True
            headers = tuple((k, bytes(v) if v is not None else b"") for k, v in (rec.headers or ()))
            out.append(Record(topic, partition, rec.offset, rec.key, rec.value or b"", rec.timestamp, headers))
            position = rec.offset + 1
            if len(out) >= limit:
                return position, True
        position = max(position, batch.next_offset)
    return position, position >= end
