"""A key/value table shared by every process of a fleet: one compacted topic, read back by each.

Any process that needs state which must not live in its own memory (an edge's stored responses
and their resume positions, a batch job's status) keeps it in a :class:`CompactedTable`:

* ``put(key, value)`` sends one record keyed by ``key`` and returns once the bus acknowledged it
  (``acks=all`` on Kafka); ``delete(key)`` sends a tombstone (an empty value). The newest record
  of a key is its value; a key's records share a partition, so they stay in order.
* every process runs one reader of the whole topic from its start (a group-less consumer, owned by
  the table's task) into a bounded in-memory view: a process started cold rebuilds the view from
  the topic, nothing is lost with a process.
* ``get(key)`` answers from the view; on a miss it first waits until the reader has caught up with
  the topic's end as it is now (the consumer's lag is 0), so a key another process wrote before it
  answered its client is found here too (read-after-write across the fleet), within ``timeout_s``.

Bounds: ``retention_ms`` (records older than it are gone: the topic's ``retention.ms`` with
``cleanup.policy=compact,delete``, and the view forgets them too, so every process agrees),
``max_entries`` and ``max_bytes`` (the view's count and the sum of its values' sizes: it keeps the
newest; older ones are evicted and read as missing in this process) and
``max_value_bytes`` (a larger value is refused with ``ValueError``: Kafka's default record size
is 1 MiB). On the memory bus the topic is not compacted (records are kept until retention), which
the view cannot tell apart.

Concurrency: one event loop; ``put``/``delete``/``get`` may be called from any task, the reader
task is the only one that reads the consumer. Pending ``get`` waits are bounded (``MAX_WAITERS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bus.base import Bus, BusError, Consumer, Record, TopicSpec
from bus.partitioner import partition_for_key

log = logging.getLogger(__name__)

MAX_WAITERS = 4096
POLL_MS = 100


@dataclass(frozen=True, slots=True)
class TableEntry:
    """One key's newest value as the view holds it: where it sits on the topic (``partition``,
    ``offset``: a record older than this one is never applied over it) and when it was written."""

    value: bytes
    partition: int
    offset: int
    timestamp_ms: int


class CompactedTable:
    """See the module docstring. ``spec`` names the topic (made compacted by :meth:`start`);
    ``clock``: wall-clock milliseconds (record timestamps are wall clock)."""

    def __init__(self, bus: Bus, spec: TopicSpec, *, max_entries: int = 100_000, max_value_bytes: int = 1 << 20,
                 max_bytes: int = 256 << 20, clock: Callable[[], float] = time.time) -> None:
        if max_entries < 1 or max_value_bytes < 1 or max_bytes < max_value_bytes:
            raise ValueError(f"max_entries and max_value_bytes must be >= 1 and max_bytes >= max_value_bytes, got "
                             f"{max_entries}, {max_value_bytes}, {max_bytes}")
        if spec.retention_ms is not None and spec.retention_ms == 0:
            raise ValueError("retention_ms must be > 0, -1 (forever) or None (the broker's default)")
        self.bus = bus
        self.spec = TopicSpec(spec.name, spec.partitions, spec.replication, spec.retention_ms, compact=True)
        self.topic = spec.name
        self.max_entries = max_entries
        self.max_value_bytes = max_value_bytes
        self.max_bytes = max_bytes
        self._bytes = 0  # the values' sizes in the view
        self.clock = clock
        self._view: OrderedDict[str, TableEntry] = OrderedDict()
        self._waiters: list[asyncio.Future[None]] = []
        self._task: asyncio.Task[None] | None = None
        self._consumer: Consumer | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        await self.bus.ensure_topics([self.spec])
        self._consumer = self.bus.consumer([self.topic], group_id=None, start_from="earliest")
        await self._consumer.start()
        self._task = asyncio.get_running_loop().create_task(self._read(), name=f"table-{self.topic}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        for w in self._waiters:
            if not w.done():
                w.cancel()
        self._waiters.clear()

    async def __aenter__(self) -> CompactedTable:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __len__(self) -> int:
        return len(self._view)

    # --- writes -------------------------------------------------------------------------------
    async def put(self, key: str, value: bytes) -> None:
        """Write ``key`` = ``value`` (non-empty) for the whole fleet. Raises ``ValueError`` for an
        empty or oversized value, :class:`BusError` when the bus does not take it."""
        if not value:
            raise ValueError("a table value must be non-empty (the empty value is the delete marker)")
        if len(value) > self.max_value_bytes:
            raise ValueError(f"value of {len(value)} bytes for key {key[:80]!r} exceeds max_value_bytes "
                             f"{self.max_value_bytes}")
        await self._write(key, value)

    async def delete(self, key: str) -> None:
        """Delete ``key`` for the whole fleet (a tombstone record)."""
        await self._write(key, b"")

    async def _write(self, key: str, value: bytes) -> None:
        if not key:
            raise ValueError("a table key must be a non-empty string")
        # the partition named, not left to the bus: a reader that owns partitions (a consumer group
        # on the table's topic, e.g. the batch runners) finds each key where partition_of says
        md = await self.bus.send(self.topic, value, key=key.encode(), partition=self.partition_of(key))
        # read-your-writes here at once; the reader applies the same record later (a no-op)
        self._apply(key, value, md.partition, md.offset, md.timestamp_ms)

    # --- reads --------------------------------------------------------------------------------
    def peek(self, key: str) -> bytes | None:
        """The value in this process's view now (no waiting); ``None`` when absent or expired."""
        e = self._view.get(key)
        if e is None:
            return None
        if self._expired(e):
            del self._view[key]
            self._bytes -= len(e.value)
            return None
        return e.value

    def items(self, prefix: str = "") -> Iterator[tuple[str, bytes]]:
        """A snapshot of the view's live entries whose key starts with ``prefix`` (oldest first)."""
        return iter([(k, e.value) for k, e in list(self._view.items())
                     if k.startswith(prefix) and not self._expired(e)])

    def partition_of(self, key: str) -> int:
        """The partition ``key``'s records go to (Kafka's default partitioner over the key)."""
        return partition_for_key(key.encode(), self.spec.partitions)

    async def get(self, key: str, timeout_s: float = 5.0) -> bytes | None:
        """The value of ``key``; on a miss, after the view caught up with the topic as it is now.
        Raises :class:`BusError` when it cannot catch up within ``timeout_s``."""
        got = self.peek(key)
        if got is not None:
            return got
        await self.sync(timeout_s)
        return self.peek(key)

    async def sync(self, timeout_s: float = 5.0) -> None:
        """Return once the view holds every record written before the call (the reader's lag is 0)."""
        if self._task is None:
            raise BusError(f"table {self.topic} is not started")
        if len(self._waiters) >= MAX_WAITERS:
            raise BusError(f"table {self.topic}: too many reads waiting for the view to catch up")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(timeout_s):
                await fut
        except TimeoutError:
            raise BusError(f"table {self.topic}: the view did not catch up within {timeout_s:g} s") from None
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)

    # --- the view -----------------------------------------------------------------------------
    def _expired(self, e: TableEntry) -> bool:
        r = self.spec.retention_ms
        return r is not None and r > 0 and self.clock() * 1000 - e.timestamp_ms > r

    def _apply(self, key: str, value: bytes, partition: int, offset: int, timestamp_ms: int) -> None:
        old = self._view.get(key)
        if old is not None and old.partition == partition and old.offset >= offset:
            return  # already newer here (our own write applied before the reader saw it)
        if old is not None:
            del self._view[key]
            self._bytes -= len(old.value)
        e = TableEntry(value, partition, offset, timestamp_ms)
        if not value or self._expired(e):
            return
        self._view[key] = e
        self._bytes += len(value)
        while len(self._view) > self.max_entries or self._bytes > self.max_bytes:
            _, gone = self._view.popitem(last=False)
            self._bytes -= len(gone.value)

    def _apply_record(self, rec: Record) -> None:
        if rec.key is None:
            return
        try:
            key = rec.key.decode()
        except UnicodeDecodeError:
            log.warning("table %s: record %d@%d has a key that is not UTF-8; skipped", self.topic, rec.partition,
                        rec.offset)
            return
        self._apply(key, rec.value, rec.partition, rec.offset, rec.timestamp_ms)

    async def _read(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while True:
            try:
                records = await consumer.getmany(timeout_ms=POLL_MS, max_records=4096)
            except BusError as exc:
                log.warning("table %s: fetch failed (%s)", self.topic, exc)
                await asyncio.sleep(POLL_MS / 1000)
                continue
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # a getmany that swallowed our cancel
                raise asyncio.CancelledError
            for rec in records:
                self._apply_record(rec)
            if self._waiters:
                try:
                    caught_up = not any((await consumer.lag()).values())
                except BusError:
                    continue
                if caught_up:
                    waiters, self._waiters = self._waiters, []
                    for w in waiters:
                        if not w.done():
                            w.set_result(None)
