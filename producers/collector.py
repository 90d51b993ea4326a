"""A reply-topic collector: assembles the replies of the requests a producer is waiting for.

A producer (batch job, replay, bus-mode benchmark) owns one reply topic. ``ReplyCollector`` reads
it with one group-less consumer and resolves one future per expected request id with a
:class:`Reply` once the request's ``Finished`` (or ``Error``) arrives.

Dedupe: chunks are keyed by (request_id, seq). After a worker crash a request is re-run and its
chunks are re-sent from seq 0 (with a higher ``attempt``); the collector keeps the next index it
expects and drops what it already has, so every token shows up once. A chunk that starts past the
expected index (a lost record) is counted in ``gaps`` and kept.

Concurrency and cancellation: ``expect``/``forget`` are called from the event loop that runs the
collector. ``start()`` creates the one reader task; ``stop()`` cancels it, stops the consumer and
cancels every future still pending (awaiters get ``CancelledError``). Replies for ids nobody
expects (earlier runs, other producers) are counted in ``unknown`` and dropped. Memory is bounded
by the number of expected requests (``max_pending``; ``expect`` raises beyond it).

The topic is the producer's own, one per run or job: :meth:`ReplyCollector.retire` stops the
collector and deletes the topic when every request it waited for was answered (else a long-lived
cluster keeps one 6-partition topic per batch job, replay and benchmark run, for ever; Kafka has
no topic expiry). A request given up on (timeout, cancel) may still be answered: its topic stays,
since a worker finding a reply topic gone dead-letters the request (``docs/worker.md``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from bus import Bus, BusError, Consumer, DecodeError, Error, Finished, StartFrom, TokenChunk, decode, replies_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Reply:
    """The assembled reply of one request. ``chunk_times``: ``clock()`` when each chunk carrying
    new tokens was read; ``done_at``: when Finished/Error was read."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    chunk_times: tuple[float, ...]
    done_at: float
    finished: Finished | None = None
    error: Error | None = None
    duplicates: int = 0
    gaps: int = 0

    @property
    def ok(self) -> bool:
        return self.finished is not None and self.error is None


class _Pending:
    __slots__ = ("future", "tokens", "text", "text_len", "times", "dups", "gaps")

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.text_len = 0
        self.times: list[float] = []
        self.dups = 0
        self.gaps = 0


def merge_chunk(p: _Pending, chunk: TokenChunk, now: float) -> bool:
    """Add the new part of ``chunk`` to ``p``; returns False when it was entirely a duplicate."""
    have = len(p.tokens)
    end = chunk.seq + len(chunk.token_ids)
    if end <= have:
        p.dups += 1
        return False
    if chunk.seq > have:
        p.gaps += 1
        skip = 0
    else:
        skip = have - chunk.seq
    p.tokens.extend(chunk.token_ids[skip:])
    text = chunk.text
    if skip:
        cut = max(0, p.text_len - chunk.text_offset)  # text_offset = chars before this chunk's text
        text = text[cut:]
    p.text.append(text)
    p.text_len += len(text)
    p.times.append(now)
    return True


class ReplyCollector:
    def __init__(self, bus: Bus, topic: str, *, start_from: StartFrom = "latest",
                 clock: Callable[[], float] = time.perf_counter, max_pending: int = 100_000) -> None:
        self.bus = bus
        self.topic = topic
        self.start_from = start_from
        self.clock = clock
        self.max_pending = max_pending
        self.pending: dict[str, _Pending] = {}
        self.unknown = 0
        self.undecodable = 0
        self.duplicates = 0
        self.abandoned = 0  # requests given up on before their final reply: they may still answer
        self._task: asyncio.Task | None = None
        self._consumer: Consumer | None = None

    async def start(self) -> None:
        """Start reading (the topic must exist). Records published after this returns are seen."""
        if self._task is not None:
            return
        self._consumer = self.bus.consumer([self.topic], group_id=None, start_from=self.start_from)
        await self._consumer.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"collector:{self.topic}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        for p in self.pending.values():
            p.future.cancel()
        self.abandoned += len(self.pending)
        self.pending.clear()

    async def retire(self) -> bool:
        """:meth:`stop`, then delete the reply topic unless a request was given up on (it may still
        be answered there). True when deleted. A failed delete is logged, never raised: the run's
        own outcome matters more than its clean-up."""
        await self.stop()  # the consumer first: a running one would have the broker re-create the topic
        if self.abandoned:
            log.info("kept reply topic %s: %d requests given up on may still be answered there",
                     self.topic, self.abandoned)
            return False
        try:
            await self.bus.delete_topics([self.topic])
        except BusError as exc:
            log.warning("could not delete reply topic %s: %s", self.topic, exc)
            return False
        return True

    async def __aenter__(self) -> ReplyCollector:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def expect(self, request_id: str) -> asyncio.Future[Reply]:
        """Register before publishing the request; await the future for its reply."""
        if request_id in self.pending:
            raise ValueError(f"already waiting for {request_id!r}")
        if len(self.pending) >= self.max_pending:
            raise RuntimeError(f"collector already waits for {self.max_pending} requests")
        fut = asyncio.get_running_loop().create_future()
        self.pending[request_id] = _Pending(fut)
        return fut

    def forget(self, request_id: str) -> None:
        """Stop waiting (timeout, cancel); later replies for it count as unknown."""
        p = self.pending.pop(request_id, None)
        if p is not None and not p.future.done():
            p.future.cancel()
            self.abandoned += 1

    def progress(self, request_id: str) -> int:
        """Tokens received so far for a pending request (0 if unknown)."""
        p = self.pending.get(request_id)
        return len(p.tokens) if p else 0

    async def _run(self) -> None:
        assert self._consumer is not None
        while True:
            records = await self._consumer.getmany(timeout_ms=100, max_records=2048)
            if not records:
                continue
            now = self.clock()
            for rec in records:
                try:
                    msgs = replies_of(decode(rec.value))
                except DecodeError:
                    self.undecodable += 1
                    continue
                for msg in msgs:
                    self._on_message(msg, now)

    def _on_message(self, msg: object, now: float) -> None:
        rid = getattr(msg, "request_id", None)
        if not isinstance(rid, str) or (p := self.pending.get(rid)) is None:
            self.unknown += 1
            return
        if isinstance(msg, TokenChunk):
            if not merge_chunk(p, msg, now):
                self.duplicates += 1
        elif isinstance(msg, (Finished, Error)):
            del self.pending[rid]
            reply = Reply(rid, tuple(p.tokens), "".join(p.text), tuple(p.times), now,
                          msg if isinstance(msg, Finished) else None, msg if isinstance(msg, Error) else None,
                          p.dups, p.gaps)
            if not p.future.done():
                p.future.set_result(reply)
