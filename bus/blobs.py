"""Payloads larger than one Kafka record, stored as a run of chunk records on one compacted topic.

Kafka refuses a record above the producer's ``max.request.size`` (1 MiB here by default), so a
blob is cut into ``chunk_bytes`` pieces sent in order to one partition (the blob id's), each keyed
``<blob id>/<index>``. :meth:`BlobStore.write` returns a :class:`BlobRef` (the partition, the
offsets of the first and last chunk, a wall-clock time taken before the first send, the size and
SHA-256); whoever keeps the reference (a :class:`bus.table.Table` entry) can read the blob back from
any process: :meth:`BlobStore.read` asks the partition for the records from that time on (the
broker's time index), keeps the chunks whose offsets the reference names, and checks the digest.
Other blobs' chunks written meanwhile to the same partition are skipped; the slice read grows
until it covers the reference's offsets, so a read costs the blob plus what was interleaved.

A delete writes an empty record over each chunk key (compaction then drops the chunk). Memory:
a read holds the whole blob (callers bound blob sizes: the Files API's ``--max-file-bytes``).
Generic: the Files API stores file contents here (docs/protocol.md, "Files and batches").
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from bus.base import Bus, BusError, TopicSpec
from bus.partitioner import partition_for_key

DEFAULT_CHUNK_BYTES = 512 * 1024  # well under the producer's 1 MiB record limit, with room for the key


@dataclass(frozen=True, slots=True)
class BlobRef:
    """Where a blob's chunks are. JSON-friendly through :meth:`to_json`/:meth:`from_json`."""

    blob_id: str
    partition: int
    first_offset: int
    last_offset: int
    since_ms: int  # taken before the first chunk was sent: every chunk's timestamp is at or after it
    size: int
    chunks: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"blob_id": self.blob_id, "partition": self.partition, "first_offset": self.first_offset,
                "last_offset": self.last_offset, "since_ms": self.since_ms, "size": self.size,
                "chunks": self.chunks, "sha256": self.sha256}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BlobRef:
        return cls(str(d["blob_id"]), int(d["partition"]), int(d["first_offset"]), int(d["last_offset"]),
                   int(d["since_ms"]), int(d["size"]), int(d["chunks"]), str(d["sha256"]))


class BlobStore:
    def __init__(self, bus: Bus, topic: str, partitions: int = 6, replication: int = 1,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.bus = bus
        self.spec = TopicSpec(topic, partitions, replication, retention_ms=-1, compact=True)
        self.chunk_bytes = chunk_bytes

    @property
    def topic(self) -> str:
        return self.spec.name

    async def start(self) -> None:
        await self.bus.ensure_topics([self.spec])

    async def write(self, blob_id: str, data: bytes) -> BlobRef:
        """Store ``data`` (may be empty: one empty-marker chunk is not needed, zero chunks are
        written). The chunks go one after the other, each acknowledged before the next."""
        partition = partition_for_key(blob_id.encode(), self.spec.partitions)
        since_ms = int(time.time() * 1000) - 1  # the producer stamps each record with its own now, later
        first = last = -1
        n = 0
        for pos in range(0, len(data), self.chunk_bytes):
            md = await self.bus.send(self.topic, data[pos:pos + self.chunk_bytes], key=f"{blob_id}/{n}".encode(),
                                     partition=partition)
            first = md.offset if first < 0 else first
            last = md.offset
            n += 1
        return BlobRef(blob_id, partition, first, last, since_ms, len(data), n, hashlib.sha256(data).hexdigest())

    async def read(self, ref: BlobRef, timeout_s: float = 60.0) -> bytes:
        """The blob's bytes. Raises :class:`BusError` when chunks are missing (deleted, or the
        reference is not from this topic) or the digest differs."""
        if ref.chunks == 0:
            return b""
        span = ref.last_offset - ref.first_offset + 1
        slack = 256
        while True:
            records = await self.bus.read_partition(self.topic, ref.partition, ref.since_ms, limit=span + slack,
                                                    timeout_s=timeout_s)
            if not records or records[-1].offset >= ref.last_offset or len(records) < span + slack:
                break
            slack *= 4  # records of other writers came first: read a longer slice
        parts: dict[int, bytes] = {}
        prefix = f"{ref.blob_id}/".encode()
        for rec in records:
            if ref.first_offset <= rec.offset <= ref.last_offset and rec.key and rec.key.startswith(prefix):
                try:
                    parts[int(rec.key[len(prefix):])] = rec.value
                except ValueError:
                    continue
        if len(parts) != ref.chunks or any(i not in parts for i in range(ref.chunks)):
            raise BusError(f"blob {ref.blob_id}: {ref.chunks - len(parts)} of {ref.chunks} chunks are missing "
                           f"from {self.topic}[{ref.partition}]")
        data = b"".join(parts[i] for i in range(ref.chunks))
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise BusError(f"blob {ref.blob_id}: content does not match its reference (size or SHA-256)")
        return data

    async def delete(self, ref: BlobRef) -> None:
        for i in range(ref.chunks):
            await self.bus.send(self.topic, b"", key=f"{ref.blob_id}/{i}".encode(), partition=ref.partition)
