"""Where files and batches live: on the bus, shared by every edge (never one edge's memory).

Topics (``<ns>`` = the layout's namespace):

* ``<ns>.files``          a compacted table (:class:`bus.Table`): file objects by id;
* ``<ns>.files.chunks``   a compacted blob topic (:class:`bus.BlobStore`): file contents, chunked so
  Kafka's per-record limit does not cap a file (``--max-file-bytes`` does);
* ``<ns>.batches``        a compacted table: batch objects by id (status, counts, file ids);
* ``<ns>.batches.results`` a log keyed by batch id: one record per answered line, the batch's
  progress. A runner resuming a batch reads it back and skips every line that has a record;
  the first record of a line wins (a line answered twice, by two runners during a hand-over, is
  still one line of the output).

Ownership: every object carries its tenant; a lookup by another tenant finds nothing (404).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from bus import BlobRef, BlobStore, Bus, Table, TopicLayout, TopicSpec, partition_for_key
from edge.openai.batches.model import BatchObject, FileObject

RESULT_RETENTION_MS = 30 * 24 * 3600 * 1000  # longer than any batch's window
DECODE_CACHE = 100_000
INLINE_RESULT_BYTES = 768 * 1024  # a larger line answer goes to the blob topic (Kafka's record limit: 1 MiB)


@dataclass(frozen=True, slots=True)
class LineResult:
    line: int
    ok: bool  # the endpoint answered 200: the output file; else the error file
    record: dict[str, Any]


class BatchStore:
    def __init__(self, bus: Bus, layout: TopicLayout) -> None:
        ns, parts, rep = layout.namespace, layout.partitions, layout.replication
        self.bus = bus
        self.files = Table(bus, f"{ns}.files", parts, rep)
        self.blobs = BlobStore(bus, f"{ns}.files.chunks", parts, rep)
        self.batches = Table(bus, f"{ns}.batches", parts, rep)
        self.results_spec = TopicSpec(f"{ns}.batches.results", parts, rep, RESULT_RETENTION_MS)
        self._cache: dict[bytes, BatchObject] = {}

    async def start(self) -> None:
        await self.bus.ensure_topics([self.results_spec])
        await self.blobs.start()
        await self.files.start()
        await self.batches.start()

    async def stop(self) -> None:
        await self.batches.stop()
        await self.files.stop()

    # --- files --------------------------------------------------------------------------------
    def file(self, tenant: str, file_id: str) -> FileObject | None:
        raw = self.files.get(file_id)
        f = FileObject.loads(raw) if raw is not None else None
        return f if f is not None and f.tenant == tenant else None

    def files_of(self, tenant: str) -> list[FileObject]:
        out = [FileObject.loads(v) for _, v in self.files.items()]
        return [f for f in out if f.tenant == tenant]

    async def add_file(self, tenant: str, file_id: str, filename: str, purpose: str, data: bytes) -> FileObject:
        """Store the content first, then the object: a file that is listed is readable."""
        ref = await self.blobs.write(file_id, data)
        f = FileObject(file_id, tenant, len(data), int(time.time()), filename, purpose, ref)
        await self.files.put(file_id, f.dumps())
        return f

    async def content(self, f: FileObject) -> bytes:
        return await self.blobs.read(f.blob)

    async def delete_file(self, f: FileObject) -> None:
        await self.files.delete(f.id)
        await self.blobs.delete(f.blob)

    # --- batches ------------------------------------------------------------------------------
    # Keys: ``batch/<id>`` the object (written by its creator, then only by its runner);
    # ``cancel/<id>`` a cancel request (written by any edge), so a runner's progress write can
    # never overwrite a cancel that it has not read yet.
    def batch(self, batch_id: str, tenant: str | None = None) -> BatchObject | None:
        """The batch as stored; with ``tenant``, only when it is that tenant's."""
        raw = self.batches.get("batch/" + batch_id)
        b = self._decoded(raw) if raw is not None else None
        return b if b is not None and (tenant is None or b.tenant == tenant) else None

    def all_batches(self) -> list[BatchObject]:
        return [self._decoded(v) for _, v in self.batches.items("batch/")]

    def _decoded(self, raw: bytes) -> BatchObject:
        """Decoded once per stored version (the runner scans every batch several times a second)."""
        b = self._cache.get(raw)
        if b is None:
            if len(self._cache) >= DECODE_CACHE:
                self._cache.clear()
            b = self._cache[raw] = BatchObject.loads(raw)
        return b

    def view(self, b: BatchObject) -> BatchObject:
        """The batch as clients see it: an active batch with a cancel request is ``cancelling``."""
        at = self.cancelled_at(b.id)
        if at is not None and b.status in ("validating", "in_progress"):
            return b.moved("cancelling", at)
        return b

    async def put_batch(self, b: BatchObject) -> None:
        await self.batches.put("batch/" + b.id, b.dumps())

    def cancelled_at(self, batch_id: str) -> int | None:
        raw = self.batches.get("cancel/" + batch_id)
        return int(json.loads(raw)["at"]) if raw is not None else None

    async def cancel(self, batch_id: str) -> None:
        if self.cancelled_at(batch_id) is None:
            await self.batches.put("cancel/" + batch_id, json.dumps({"at": int(time.time())}).encode())

    def batch_partition(self, batch_id: str) -> int:
        return self.batches.partition_of("batch/" + batch_id)

    # --- results ------------------------------------------------------------------------------
    async def add_result(self, batch_id: str, r: LineResult) -> None:
        head = {"batch": batch_id, "line": r.line, "ok": r.ok}
        record = json.dumps(r.record, separators=(",", ":")).encode()
        if len(record) > INLINE_RESULT_BYTES:  # e.g. many embeddings in one line: too big for one record
            ref = await self.blobs.write(f"result-{batch_id}-{r.line}-{secrets.token_hex(4)}", record)
            value = json.dumps({**head, "blob": ref.to_json()}).encode()
        else:
            value = json.dumps({**head, "record": r.record}, separators=(",", ":")).encode()
        await self.bus.send(self.results_spec.name, value, key=batch_id.encode(), partition=self._part(batch_id))

    async def results(self, b: BatchObject) -> dict[int, LineResult]:
        """Every line of ``b`` answered so far, by line number (the first record of each)."""
        since_ms = b.created_at * 1000 - 1000
        recs = await self.bus.read_partition(self.results_spec.name, self._part(b.id), since_ms, limit=10_000_000)
        key = b.id.encode()
        decoded = await asyncio.to_thread(lambda: [json.loads(r.value) for r in recs if r.key == key])  # off the loop
        out: dict[int, LineResult] = {}
        for d in decoded:
            line = int(d["line"])
            if line not in out:
                record = d["record"] if "record" in d else json.loads(await self.blobs.read(BlobRef.from_json(d["blob"])))
                out[line] = LineResult(line, bool(d["ok"]), record)
        return out

    def _part(self, batch_id: str) -> int:
        return partition_for_key(batch_id.encode(), self.results_spec.partitions)
