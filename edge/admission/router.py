"""Reply routing: ONE consumer of the edge's own reply topic feeds every session.

Each admitted request is a :class:`~edge.admission.lifecycle.Stream` registered with the
:class:`~edge.admission.lifecycle.Lifecycle` under its request id. The router task decodes each
reply record (one reply, or a worker step's batch of them), drops duplicates by (request id, seq)
and hands the rest to the lifecycle, which counts it and passes it to the stream's sink (the
WebSocket session, or an OpenAI HTTP response), which only appends to a bounded queue — routing
never awaits a client, so one slow client cannot stall the others.

Dedupe: a stream keeps ``next_seq`` (the next output index it expects) and ``chars`` (output
characters delivered). A chunk entirely below ``next_seq`` is a duplicate (a worker re-running the
request after a crash re-sends from seq 0 with the same tokens) and is dropped; a chunk that
overlaps is trimmed by tokens and, using ``text_offset``, by characters. Records for request ids
the edge no longer tracks (finished, cancelled, from a previous edge life) are counted and dropped.

Concurrency: all methods run on the edge's event loop; :meth:`run` is the only task that reads the
consumer. Cancelling :meth:`run` stops the consumer and loses nothing that matters (reply topics are
per edge; in-flight streams are ended by their handlers' :class:`~edge.admission.lifecycle.OwnedStreams`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import orjson

from bus import (
    SCHEMA_VERSION,
    Bus,
    DecodeError,
    Error,
    ErrorCode,
    Finished,
    LoraAck,
    Message,
    Record,
    TokenChunk,
    decode,
    replies_of,
)
from edge.admission.lifecycle import Lifecycle, Stream
from edge.metrics import EdgeMetrics

log = logging.getLogger(__name__)


def checkpoint() -> None:
    """Raise ``CancelledError`` if this task was cancelled but the cancellation got swallowed.

    Python 3.11's ``asyncio.wait_for`` (used inside some ``getmany`` implementations) returns the
    inner result instead of raising when the cancel arrives just as the inner await completes, so a
    ``while True: await consumer.getmany()`` loop would never end. Every consume loop calls this."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


_CHUNK_KEYS = frozenset(("request_id", "attempt", "seq", "token_ids", "text", "text_offset", "logprobs", "worker_id"))
_BATCH_KEYS = frozenset(("v", "type", "chunks", "finished", "errors"))


def _fast_chunk(obj: object) -> TokenChunk | None:
    """``obj`` (a decoded JSON value) as a ``TokenChunk`` when it is a plain one (no logprobs) that
    passes the same checks as the generic decoder; ``None`` means: take the generic path."""
    if type(obj) is dict and obj.keys() <= _CHUNK_KEYS and obj.get("logprobs") is None:
        rid, attempt, seq = obj.get("request_id"), obj.get("attempt"), obj.get("seq")
        ids, text, off = obj.get("token_ids"), obj.get("text"), obj.get("text_offset")
        if type(rid) is str and type(attempt) is int and type(seq) is int and type(ids) is list \
                and (len(ids) == 1 and type(ids[0]) is int or all(type(t) is int for t in ids)) \
                and type(text) is str and type(off) is int \
                and type(obj.get("worker_id", "")) is str:
            return TokenChunk(rid, attempt, seq, tuple(ids), text, off, None, obj.get("worker_id", ""))
    return None


def decode_reply(value: bytes) -> tuple[Message, ...]:
    """Decode a reply record into the replies it carries, in order (:func:`replies_of`): a fast,
    equally strict path for ``TokenChunk`` and for a ``ReplyBatch`` of chunks only (the hot records:
    one per token, or one per worker step), :func:`bus.messages.decode` for everything else.
    Raises ``DecodeError`` for a bad record (nothing of a bad batch is used)."""
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError:
        return replies_of(decode(value))  # raises a DecodeError saying why
    if type(obj) is dict and obj.get("v") == SCHEMA_VERSION:
        kind = obj.get("type")
        if kind == "chunk":
            del obj["v"], obj["type"]
            chunk = _fast_chunk(obj)
            if chunk is not None:
                return (chunk,)
        elif kind == "replies" and obj.keys() <= _BATCH_KEYS and not obj.get("finished") and not obj.get("errors"):
            items = obj.get("chunks")
            if type(items) is list:
                chunks = tuple(map(_fast_chunk, items))
                if None not in chunks:
                    return chunks  # type: ignore[return-value]  # no None among them (checked above); a cast would cost on this hot path
    return replies_of(decode(value))


class SpliceMismatch(Exception):
    """A chunk overlapping what a stream already delivered carries other token ids there: two
    attempts of one request diverged (a re-run after a worker failure drew other tokens)."""


def dedupe(stream: Stream, chunk: TokenChunk) -> tuple[int, str, tuple[int, ...], tuple | None] | None:
    """The new part of ``chunk`` for ``stream`` as (seq, text, token_ids, logprobs), advancing the
    stream, or ``None`` when nothing in it is new. Pure apart from updating ``stream``.

    Where the chunk overlaps tokens already delivered, its ids there must equal them: a stream is
    never spliced from two different answers. A difference raises :class:`SpliceMismatch`."""
    n = len(chunk.token_ids)
    end = chunk.seq + n
    if chunk.seq < stream.next_seq and n:
        upto = min(end, stream.next_seq)
        if list(chunk.token_ids[:upto - chunk.seq]) != stream.delivered[chunk.seq:upto]:
            raise SpliceMismatch(f"seq {chunk.seq}..{upto - 1}")
    if end <= stream.next_seq and n:
        return None
    skip = max(0, stream.next_seq - chunk.seq)
    token_ids = chunk.token_ids[skip:] if skip else chunk.token_ids
    logprobs = chunk.logprobs[skip:] if (skip and chunk.logprobs is not None) else chunk.logprobs
    seq = chunk.seq + skip
    text = chunk.text
    text_end = chunk.text_offset + len(text)
    if text_end <= stream.chars:
        text = ""
    elif chunk.text_offset < stream.chars:
        text = text[stream.chars - chunk.text_offset:]
    if not token_ids and not text:
        return None
    stream.next_seq = max(stream.next_seq, end)
    stream.chars = max(stream.chars, text_end)
    stream.delivered.extend(token_ids)
    return seq, text, token_ids, logprobs


class ReplyRouter:
    """Reads the reply topic and hands each stream's new output, its end or its error to the
    :class:`~edge.admission.lifecycle.Lifecycle` (which counts, releases and feeds the sink)."""

    def __init__(self, bus: Bus, topic: str, metrics: EdgeMetrics, lifecycle: Lifecycle) -> None:
        self.bus = bus
        self.topic = topic
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.connected = False
        self._ready = asyncio.Event()
        # a worker's answer to a run-time LoRA load or unload (edge/admission/loras.py)
        self.on_lora_ack: Callable[[LoraAck], None] | None = None

    @property
    def streams(self) -> dict[str, Stream]:
        """The open streams by request id (the lifecycle's registry; read-only here)."""
        return self.lifecycle.streams

    async def wait_ready(self) -> None:
        """Return once the consumer is started (records sent after this are seen)."""
        await self._ready.wait()

    async def run(self) -> None:
        consumer = self.bus.consumer([self.topic], group_id=None, start_from="latest")
        await consumer.start()
        self.connected = True
        self._ready.set()
        try:
            while True:
                records = await consumer.getmany(timeout_ms=200, max_records=4096)
                checkpoint()
                if records:
                    for rec in records:
                        self._route(rec)
                    # One observation per batch, of its oldest record (records arrive in order):
                    # the routing lag, without a histogram update per token.
                    self.metrics.route.observe(max(0.0, time.time() - records[0].timestamp_ms / 1000))
                    self.metrics.flush_generated()
        finally:
            self.connected = False
            await consumer.stop()

    def _route(self, rec: Record) -> None:
        try:
            msgs = decode_reply(rec.value)
        except DecodeError as exc:
            self.metrics.bad_records.inc()
            log.warning("undecodable record on %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, exc)
            return
        for msg in msgs:
            self._route_one(msg, rec)

    def _route_one(self, msg: Message, rec: Record) -> None:
        lifecycle = self.lifecycle
        if isinstance(msg, LoraAck):
            if self.on_lora_ack is not None:
                self.on_lora_ack(msg)
            return
        stream = lifecycle.streams.get(getattr(msg, "request_id", ""))
        if stream is None:
            self.metrics.orphans.inc()
            return
        attempt = getattr(msg, "attempt", 0)
        if attempt < stream.attempt:
            # A fenced run: its worker was presumed dead and the request taken over (a higher
            # attempt already replied). Even its identical tokens are dropped, and its final reply:
            # the stream follows one run from the takeover on (docs/worker.md, "Failover").
            self.metrics.fenced.inc()
            return
        stream.attempt = attempt
        if isinstance(msg, TokenChunk):
            try:
                new = dedupe(stream, msg)
            except SpliceMismatch as exc:
                self._diverged(stream, msg, str(exc))
                return
            if new is None:
                self.metrics.duplicates.inc()
                return
            lifecycle.delta(stream, *new)
        elif isinstance(msg, Finished):
            lifecycle.finish(stream, msg)
        elif isinstance(msg, Error):
            lifecycle.fail(stream, msg.code, msg.message, msg.retry_after)
        else:
            log.warning("unexpected %s on reply topic %s", type(msg).__name__, rec.topic)

    def _diverged(self, stream: Stream, chunk: TokenChunk, where: str) -> None:
        """End a stream whose re-run diverged from what its client already has: a retryable error,
        never a mixed answer; the attempt still running is cancelled."""
        self.metrics.splice_mismatches.inc()
        log.warning("request %s: attempt %d diverged from the tokens already sent (%s); ending the stream",
                    stream.request_id, chunk.attempt, where)
        self.lifecycle.fail(stream, ErrorCode.INTERNAL,
                            "the request was re-run after a worker failure and its output diverged from the tokens "
                            "already sent; retry the request", 0.0, cancel="diverged")
