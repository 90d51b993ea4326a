"""A key -> value table on one compacted topic, read whole into memory by every process that opens it.

The topic is the truth: ``put`` and ``delete`` append a record keyed by the table key (a delete is
an empty value), the broker's compaction keeps the last record of each key, and every reader
replays the topic from its start and then follows it, so every process sharing the bus sees the
same table (a restart loses nothing). Values are small (one record each: at most the producer's
``max_request_size``); large payloads go to :mod:`bus.blobs` and the table holds their reference.

Start-up: each partition is read to its end (``Bus.read_partition``), then a group-less consumer
follows the topic from its start, skipping what that replay applied.

Read-your-writes: ``put``/``delete`` apply the new value locally once the bus acknowledged it.
The follower skips, per key, a record older than the newest local write it has not read back yet,
so a late-arriving older record never rolls the view back; records written after it by other
processes win, in log order (last writer wins, as compaction decides).

Generic (values are bytes): the OpenAI Files and Batches API keeps its file and batch objects in
tables (docs/protocol.md, "Files and batches"). Lifecycle: ``start()`` creates the topic if
needed, replays it and starts the follower task; ``stop()`` ends it. Owned by its opener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from bus.base import Bus, BusError, Consumer, Record, TopicSpec
from bus.partitioner import partition_for_key

log = logging.getLogger(__name__)


class Table:
    def __init__(self, bus: Bus, topic: str, partitions: int = 6, replication: int = 1) -> None:
        self.bus = bus
        self.spec = TopicSpec(topic, partitions, replication, retention_ms=-1, compact=True)
        self._values: dict[str, bytes] = {}
        self._replayed: dict[int, int] = {}  # partition -> last offset the start-up replay applied
        self._unread: dict[str, tuple[int, int]] = {}  # key -> (partition, offset) of our write not yet read back
        self._consumer: Consumer | None = None
        self._task: asyncio.Task | None = None

    @property
    def topic(self) -> str:
        return self.spec.name

    async def start(self, timeout_s: float = 30.0) -> None:
        """Create the topic if needed, read it to its end, then follow it."""
        if self._task is not None:
            return
        await self.bus.ensure_topics([self.spec])
        # The replay reads each partition up to its end as of the call (Bus.read_partition, the
        # primitive a worker's resume uses); the follower then reads from the start and skips what
        # the replay applied, so nothing written meanwhile is missed and nothing is applied twice.
        replayed: dict[int, int] = {}
        deadline = asyncio.get_running_loop().time() + timeout_s
        for p in range(self.spec.partitions):
            while True:
                left = deadline - asyncio.get_running_loop().time()
                try:
                    records = await self.bus.read_partition(self.topic, p, 0, limit=1 << 62, timeout_s=max(left, 0.1))
                    break
                except BusError:  # a topic just created: its partitions' leaders may not answer yet
                    if left <= 0:
                        raise
                    await asyncio.sleep(0.2)
            self._apply_all(records)
            replayed[p] = records[-1].offset if records else -1
        self._replayed = replayed
        self._consumer = self.bus.consumer([self.topic], group_id=None, start_from="earliest")
        await self._consumer.start()
        self._task = asyncio.get_running_loop().create_task(self._follow(), name=f"table:{self.topic}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    def partition_of(self, key: str) -> int:
        """The partition ``key``'s records go to (Kafka's default partitioner)."""
        return partition_for_key(key.encode(), self.spec.partitions)

    def get(self, key: str) -> bytes | None:
        return self._values.get(key)

    def items(self, prefix: str = "") -> Iterator[tuple[str, bytes]]:
        """A snapshot of the entries whose key starts with ``prefix``."""
        return iter([(k, v) for k, v in self._values.items() if k.startswith(prefix)])

    async def put(self, key: str, value: bytes) -> None:
        if not value:
            raise ValueError("a table value must not be empty (an empty value is a delete)")
        await self._write(key, value)

    async def delete(self, key: str) -> None:
        await self._write(key, b"")

    async def _write(self, key: str, value: bytes) -> None:
        md = await self.bus.send(self.topic, value, key=key.encode(), partition=self.partition_of(key))
        self._unread[key] = (md.partition, md.offset)
        self._set(key, value)

    def _set(self, key: str, value: bytes) -> None:
        if value:
            self._values[key] = value
        else:
            self._values.pop(key, None)

    def _apply_all(self, records: list[Record]) -> None:
        for rec in records:
            if rec.key is None or rec.offset <= self._replayed.get(rec.partition, -1):
                continue
            try:
                key = rec.key.decode()
            except UnicodeDecodeError:
                continue
            mine = self._unread.get(key)
            if mine is not None:
                if (rec.partition, rec.offset) < mine:
                    continue  # older than our own acknowledged write: the view already holds newer
                if (rec.partition, rec.offset) == mine:
                    del self._unread[key]
            self._set(key, rec.value)

    async def _follow(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                self._apply_all(await self._consumer.getmany(timeout_ms=200, max_records=4096))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broker outage: keep following, the consumer reconnects
                log.warning("table %s: read failed: %s", self.topic, exc)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.sleep(1.0)
