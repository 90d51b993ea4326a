"""Dead letters: records that cannot be decoded go to the layout's DLQ topic, consumption continues.

(Workers also dead-letter requests whose reply topic does not exist; ``read_dead_letters`` reads
them back for ``lockgate dlq``.)

A dead letter keeps the original key and value bytes untouched and adds headers (values UTF-8):

=========================  =====================================================
``dlq.source.topic``       topic the record was read from
``dlq.source.partition``   its partition (decimal)
``dlq.source.offset``      its offset (decimal)
``dlq.source.timestamp``   its timestamp in ms (decimal)
``dlq.reason``             why it was rejected (the ``DecodeError`` text)
=========================  =====================================================

The original record's headers follow, unchanged. Consumers call :func:`decode_or_deadletter` (or a
:class:`DeadLetterer`, which also counts) for every record and skip ``None``. Publishing the dead
letter is awaited before returning, so a consumer that commits after processing never commits past
a record whose dead letter was lost; a failure to publish raises :class:`~bus.base.BusError`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from bus.base import Bus, Record, RecordMetadata, UnknownTopicError
from bus.messages import DecodeError, Message, decode
from bus.topics import TopicLayout
from bus.window import read_time_window

log = logging.getLogger(__name__)

H_TOPIC = "dlq.source.topic"
H_PARTITION = "dlq.source.partition"
H_OFFSET = "dlq.source.offset"
H_TIMESTAMP = "dlq.source.timestamp"
H_REASON = "dlq.reason"
MAX_REASON_BYTES = 1024


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A dead letter read back from the DLQ topic (see :func:`parse_dead_letter`)."""

    source_topic: str
    source_partition: int
    source_offset: int
    reason: str
    key: bytes | None
    value: bytes
    dead_at_ms: int = 0  # the dead letter's own timestamp: when it was dead-lettered


def dead_letter_headers(record: Record, reason: str) -> tuple[tuple[str, bytes], ...]:
    reason_b = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
    return (
        (H_TOPIC, record.topic.encode()),
        (H_PARTITION, str(record.partition).encode()),
        (H_OFFSET, str(record.offset).encode()),
        (H_TIMESTAMP, str(record.timestamp_ms).encode()),
        (H_REASON, reason_b),
    ) + tuple(record.headers)


async def send_dead_letter(bus: Bus, layout: TopicLayout, record: Record, reason: str) -> RecordMetadata:
    """Publish ``record`` (original key and bytes) to ``layout.dead_letter_topic`` with ``reason``."""
    log.warning("dead letter %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason)
    return await bus.send(layout.dead_letter_topic, record.value, key=record.key, headers=dead_letter_headers(record, reason))


def parse_dead_letter(record: Record) -> DeadLetter:
    """Read the provenance headers of a DLQ record. Raises ``ValueError`` when they are missing."""
    h = {k: v for k, v in record.headers if k.startswith("dlq.")}
    missing = [k for k in (H_TOPIC, H_PARTITION, H_OFFSET, H_REASON) if k not in h]
    if missing:
        raise ValueError(f"{record.topic}[{record.partition}]@{record.offset} is not a dead letter: no {missing}")
    return DeadLetter(
        source_topic=h[H_TOPIC].decode(),
        source_partition=int(h[H_PARTITION]),
        source_offset=int(h[H_OFFSET]),
        reason=h[H_REASON].decode("utf-8", "replace"),
        key=record.key,
        value=record.value,
        dead_at_ms=record.timestamp_ms,
    )


async def read_dead_letters(bus: Bus, layout: TopicLayout, since_ms: int, until_ms: int, *, limit: int = 1000,
                            idle_s: float = 2.0) -> tuple[list[DeadLetter], int]:
    """The namespace's dead letters written in ``[since_ms, until_ms]``, oldest first, at most
    ``limit``; and how many records of the topic were not dead letters (no provenance headers).
    ``([], 0)`` when the dead-letter topic does not exist (nothing was ever dead-lettered: it is
    not created by looking). How the window is read: :func:`bus.window.read_time_window`."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    try:
        await bus.partitions_for(layout.dead_letter_topic)
    except UnknownTopicError:
        return [], 0
    out: list[DeadLetter] = []
    foreign = 0
    for rec in await read_time_window(bus, [layout.dead_letter_topic], since_ms, until_ms, limit=limit, idle_s=idle_s):
        try:
            out.append(parse_dead_letter(rec))
        except ValueError:
            foreign += 1
    return out, foreign


async def decode_or_deadletter(bus: Bus, layout: TopicLayout, record: Record) -> Message | None:
    """The decoded message, or ``None`` after publishing ``record`` as a dead letter."""
    try:
        return decode(record.value)
    except DecodeError as exc:
        await send_dead_letter(bus, layout, record, str(exc))
        return None


class DeadLetterer:
    """:func:`decode_or_deadletter` bound to a bus and layout, counting what it rejected.

    Safe to share between tasks of one loop (the counter is only touched synchronously)."""

    def __init__(self, bus: Bus, layout: TopicLayout) -> None:
        self.bus = bus
        self.layout = layout
        self.dead_letters = 0

    async def decode(self, record: Record) -> Message | None:
        try:
            return decode(record.value)
        except DecodeError as exc:
            self.dead_letters += 1
            await send_dead_letter(self.bus, self.layout, record, str(exc))
            return None
