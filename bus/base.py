"""The bus interface: what every implementation (Kafka, in-memory) offers.

Semantics both implementations keep (the conformance suite in ``tests/bus`` checks them):

* Records with the same key land on the same partition, in send order.
* A consumer in a group receives the partitions the group assigns it; committed offsets survive the
  consumer. A record not committed when its consumer leaves is delivered again to another member.
* ``pause``/``resume`` stop and restart fetching from partitions without leaving the group.
* Topics keep records (retention), so a group-less consumer can read them again from any offset or
  timestamp: the priority topics are the platform's request log.

Concurrency: a :class:`Bus` may be shared by many tasks of one event loop; ``send`` is safe to call
concurrently. A :class:`Consumer` belongs to one task (one caller of ``getmany`` at a time).
Cancellation: cancelling ``getmany`` loses no records (uncommitted ones are redelivered).
"""

from __future__ import annotations

import abc
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True, order=True)
class TopicPartition:
    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...] = ()

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


@dataclass(frozen=True, slots=True)
class RecordMetadata:
    topic: str
    partition: int
    offset: int
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int = 1
    replication: int = 1
    retention_ms: int | None = None  # None = the broker default; -1 = forever
    # a compacted topic (bus.table): Kafka keeps the newest record per key (cleanup.policy
    # compact,delete: retention still applies); the memory bus keeps every record until retention
    compact: bool = False


StartFrom = Literal["earliest", "latest"] | int  # int = a timestamp in ms

RebalanceCallback = Callable[[set[TopicPartition]], Awaitable[None] | None]


_UNSAFE = re.compile(r"[^a-zA-Z0-9._-]+")
MAX_TOPIC_LEN = 249  # Kafka's limit


def safe_name(name: str) -> str:
    """Map any model/owner name onto Kafka's topic alphabet ``[a-zA-Z0-9._-]``."""
    out = _UNSAFE.sub("-", name.strip()).strip("-.") or "default"
    return out[-120:]


def validate_topic(name: str) -> str:
    if not name or len(name) > MAX_TOPIC_LEN or _UNSAFE.search(name) or name in (".", ".."):
        raise ValueError(f"invalid topic name {name!r}: use 1-{MAX_TOPIC_LEN} chars of [a-zA-Z0-9._-]")
    return name


def checked_topic_names(names: Iterable[str]) -> list[str]:
    """``names`` without repeats, in order, each checked by :func:`validate_topic` (``ValueError``
    naming a bad one)."""
    return [validate_topic(n) for n in dict.fromkeys(names)]


def check_partition_arg(partition: int | None) -> None:
    """``Bus.send``'s ``partition``: ``None`` or an int >= 0 (``ValueError`` otherwise); whether the
    topic has it is the bus's check."""
    if partition is not None and (partition.__class__ is not int or partition < 0):
        raise ValueError(f"partition must be an integer >= 0 or None, got {partition!r}")


def checked_consumer_args(topics: Sequence[str], start_from: StartFrom) -> list[str]:
    """The topic names of a new consumer, validated, after checking ``start_from``; raises
    ``ValueError`` naming the bad argument. Both buses' consumers start with it."""
    if isinstance(topics, str) or not topics:
        raise ValueError("topics must be a non-empty list of topic names")
    if not (start_from in ("earliest", "latest") or (isinstance(start_from, int) and not isinstance(start_from, bool))):
        raise ValueError(f"start_from must be 'earliest', 'latest' or a timestamp in ms, got {start_from!r}")
    return checked_topic_names(topics)


async def call_rebalance_callback(cb: RebalanceCallback | None, tps: set[TopicPartition], what: str,
                                  log: logging.Logger) -> None:
    """Run a rebalance callback (sync or async); like aiokafka, an exception is logged to ``log`` and
    does not stop the group. Both buses call it, so both treat callbacks alike."""
    if cb is None:
        return
    try:
        result = cb(tps)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("%s callback failed", what)


class BusError(RuntimeError):
    """The bus could not do what was asked (broker unreachable, topic missing, ...)."""


class UnknownTopicError(BusError):
    """The topic does not exist: the broker answered, and has no such topic. Unlike a plain
    :class:`BusError` (the broker could not be asked), waiting and retrying will not help unless
    someone creates it."""


class Consumer(abc.ABC):
    """One member of a consumer group (or a group-less reader). Use as ``async with``."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None:
        """Leave the group without committing. Idempotent."""

    @abc.abstractmethod
    async def getmany(self, timeout_ms: int = 100, max_records: int | None = None) -> list[Record]:
        """Records from the assigned, non-paused partitions, in offset order per partition.
        Returns ``[]`` after ``timeout_ms`` when nothing arrived."""

    @abc.abstractmethod
    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit, per partition, the offset of the next record to read (last processed + 1)."""

    @abc.abstractmethod
    def pause(self, *partitions: TopicPartition) -> None: ...

    @abc.abstractmethod
    def resume(self, *partitions: TopicPartition) -> None: ...

    @abc.abstractmethod
    def paused(self) -> set[TopicPartition]: ...

    @abc.abstractmethod
    def assignment(self) -> set[TopicPartition]: ...

    @abc.abstractmethod
    async def lag(self) -> dict[TopicPartition, int]:
        """Per assigned partition, the records after this consumer's position (the next record it
        would fetch) up to the partition's end now: what waits on the topic, paused partitions
        included. Raises :class:`BusError` when the broker cannot be asked."""

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class Bus(abc.ABC):
    """A connection to the bus: one shared producer plus a consumer factory. Use as ``async with``."""

    url: str

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect. Raises :class:`BusError` within the configured timeout when it cannot."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Flush pending sends and disconnect. Idempotent."""

    @abc.abstractmethod
    async def send(
        self,
        topic: str,
        value: bytes,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
        partition: int | None = None,
    ) -> RecordMetadata:
        """Send one record and wait for the acknowledgement (``acks=all`` on Kafka).

        The record goes to ``partition`` when given (``ValueError`` if the topic has no such
        partition), else to the partition Kafka's default partitioner picks for ``key``
        (:func:`bus.partitioner.partition_for_key`), else round-robin."""

    @abc.abstractmethod
    async def ensure_topics(self, specs: Iterable[TopicSpec]) -> list[str]:
        """Create the topics that do not exist; return the names created. Idempotent."""

    @abc.abstractmethod
    async def list_topics(self, prefix: str = "") -> list[str]:
        """The names of the topics that exist and start with ``prefix``, sorted; the broker's own
        internal topics (``__consumer_offsets`` and the like) are left out."""

    @abc.abstractmethod
    async def delete_topics(self, names: Iterable[str]) -> list[str]:
        """Delete these topics with their records; return the names that existed. Names that do
        not exist are skipped, so it is idempotent. Meant for throwaway namespaces (benchmarks,
        tests): a consumer still subscribed to a deleted topic reads nothing more from it, and a
        later send or subscribe creates it again, empty (auto-create). Stop the consumers of these
        topics first: on Kafka a consumer still running refreshes its metadata when its topic goes,
        and aiokafka's metadata requests ask a broker with ``auto.create.topics.enable`` (the local
        one) to create it again at once (docs/bus.md, Semantics)."""

    @abc.abstractmethod
    async def partitions_for(self, topic: str) -> list[int]:
        """The topic's partition ids, never creating it. Raises :class:`UnknownTopicError` when it
        does not exist, :class:`BusError` when the broker could not be asked or a partition has no
        leader (an election in progress: transient, never taken for a missing topic)."""

    @abc.abstractmethod
    async def read_partition(self, topic: str, partition: int, since_ms: int, limit: int = 100_000,
                             timeout_s: float = 10.0) -> list[Record]:
        """The records of one partition from the first whose timestamp is at or after ``since_ms``
        up to the partition's end as of the call (records sent meanwhile are not waited for), at
        most ``limit``, oldest first. No group, no commit. Raises :class:`UnknownTopicError` for a
        missing topic, ``ValueError`` for a partition it does not have, :class:`BusError` when the
        broker cannot be read within ``timeout_s``."""

    async def prepare_reads(self, topics: Iterable[str]) -> None:
        """Make later :meth:`read_partition` calls of ``topics`` start at once (a bus whose reads
        need connections and leader lookups opens and caches them now). Best effort: a topic that
        cannot be prepared is skipped (its read raises as ever). Nothing to do by default."""
        del topics

    @abc.abstractmethod
    def consumer(
        self,
        topics: Sequence[str],
        group_id: str | None = None,
        start_from: StartFrom = "latest",
        on_assigned: RebalanceCallback | None = None,
        on_revoked: RebalanceCallback | None = None,
    ) -> Consumer:
        """A consumer (not yet started). With ``group_id`` it joins that group and resumes from its
        committed offsets (``start_from`` applies when there are none); without, it reads every
        partition from ``start_from``."""

    async def __aenter__(self) -> Bus:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
