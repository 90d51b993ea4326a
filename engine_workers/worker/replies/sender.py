"""Ordered, coalescing reply publishing for the worker: one record per reply partition per step.

The engine's outputs arrive on the event loop once per step; publishing must neither block the
engine nor reorder a request's records. ``chunk`` queues a request's new tokens and ``final`` its
closing ``Finished``/``Error``; one task per reply topic (created on demand, ended when nothing is
queued) sends in rounds. A round takes everything queued for the topic, groups it by partition
(the one each request id maps to, as Kafka's default partitioner would map it as a key), and sends
one record per partition: the request's lone message when only one request has something, else a
:class:`~bus.messages.ReplyBatch`. The partitions' records go out concurrently; the next round
starts when all are acknowledged. Meanwhile the next steps' tokens accumulate and go out as one
``TokenChunk`` per request (``seq`` = index of its first token), so a slow bus costs fewer, larger
records rather than a backlog.

Why batch: with one record per request per step, a step of N running requests cost N sends
through the producer (each a noticeable slice of event-loop CPU on aiokafka, which is pure Python;
figures in docs/design.md, "One reply record per partition per step") and N records for every
consumer to decode; a worker's event loop shares the CPU with the engine, and an edge's router
handles every worker's records. Batched, a step costs one record per reply partition.

Ordering: a request's replies all go to one partition; within a round each request has at most
one chunk and one final, the chunk first (``replies_of`` reads them in that order); rounds of a
topic are sequential. So each request's records keep their order, and its final reply is
acknowledged only after all of its tokens are.

Failure: a record is retried ``retries`` times (backoff 0.1 s doubling); then every request in it
is forgotten here (what it still had queued too, so no later chunk leaves a gap) and
``on_failed(key, None)`` is called for each: the worker runs it again, then answers it with an
error, then dead-letters it (engine_workers/worker/replies/failures.py), never leaving it to pin its
partition's commits. While one partition's record is being retried, the topic's next round waits.
A round's record over ``max_record_bytes`` (the producer's limit) is sent as several records of
that partition, in order (engine_workers/worker/replies/split.py).
A reply topic that does not exist is not a failure that a retry or another worker can mend: its
requests are *undeliverable*, and ``on_failed(key, reason)`` says so (the worker dead-letters and
commits them, so one request naming a missing topic cannot pin its partition's commits). The
topic is checked before its first round (again over ~0.7 s before it counts as missing, as a topic
its requester has just created may not be in every broker's metadata yet) and after a failed send
(deleted since); nothing is ever sent to a missing topic, which on a broker with auto-create would
create it for no reader, and on one without would wait out the request timeout. Those checks and
the partition counts are :class:`~engine_workers.worker.reply_topics.ReplyTopics`' (``topics``).
The worker's intake asks :meth:`verify` before the first request naming a topic runs
(engine_workers/worker/replies/gate.py), so a request to a missing topic is dead-lettered without a
prefill; the rounds' own checks catch a topic deleted later.

Concurrency: ``chunk``/``final``/``drop`` are synchronous and called from the event loop only.
Memory: at most the not-yet-sent tokens of the requests in flight. ``stop`` cancels every task
(records not yet sent are lost, as in a crash: their requests are uncommitted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from bus import Bus, BusError, Error, Finished, TokenChunk, partition_for_key
from engine_workers.worker.replies.split import RECORD_OVERHEAD, Piece, reply_records
from engine_workers.worker.replies.topics import ReplyTopics, Undeliverable

log = logging.getLogger(__name__)

class _Pending:
    """One request's replies queued for the next round."""

    __slots__ = ("request_id", "attempt", "seq", "tokens", "text", "calls", "text_offset", "logprobs", "final",
                 "on_acked")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.attempt = 0
        self.seq = -1  # index of tokens[0]
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.calls: list[tuple[int, int]] = []  # per chunk() call: (tokens, text characters), to split a chunk
        self.text_offset = 0
        self.logprobs: list | None = None
        self.final: Finished | Error | None = None
        self.on_acked: Callable[[], None] | None = None

    def take_chunk(self, worker_id: str) -> TokenChunk | None:
        if not self.tokens and not self.text:
            return None
        return TokenChunk(self.request_id, self.attempt, self.seq, tuple(self.tokens), "".join(self.text),
                          self.text_offset, tuple(self.logprobs) if self.logprobs is not None else None, worker_id)


class _Topic:
    __slots__ = ("name", "queued", "task")

    def __init__(self, name: str) -> None:
        self.name = name
        self.queued: dict[str, _Pending] = {}  # request key -> its replies, in arrival order
        self.task: asyncio.Task | None = None


class ReplySender:
    def __init__(self, bus: Bus, worker_id: str, retries: int = 3,
                 on_failed: Callable[[str, str | None], None] | None = None, *,
                 max_record_bytes: int = 1 << 20) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.retries = retries
        self.on_failed = on_failed
        self.max_record_bytes = max_record_bytes  # the producer's limit: records are split under it (reply_split.py)
        self._topics: dict[str, _Topic] = {}
        self._keys: dict[str, _Topic] = {}  # request key -> its topic, until its final is acknowledged
        self._closing: set[str] = set()  # keys whose final is queued: no more chunks
        self._partition: dict[str, int] = {}  # request key -> its partition (murmur2 in Python: once)
        self.topics = ReplyTopics(bus)  # partition counts, missing topics (reply_topics.py)
        self._tasks: set[asyncio.Task] = set()
        self.records_sent = 0
        self.replies_sent = 0  # chunks and finals inside those records

    def __len__(self) -> int:
        """Requests with replies queued or in flight."""
        return len(self._keys)

    def _pending(self, key: str, topic: str, request_id: str) -> tuple[_Topic, _Pending]:
        t = self._topics.get(topic)
        if t is None:
            t = self._topics[topic] = _Topic(topic)
        p = t.queued.get(key)
        if p is None:
            p = t.queued[key] = _Pending(request_id)
        self._keys[key] = t
        return t, p

    def chunk(self, key: str, topic: str, request_id: str, attempt: int, seq: int, token_ids, text: str,
              text_offset: int, logprobs=None) -> None:
        """Queue tokens ``seq..`` of request ``key`` (contiguous with what is queued)."""
        if key in self._closing:
            raise RuntimeError(f"{key}: chunk after final")
        t, p = self._pending(key, topic, request_id)
        if not p.tokens and not p.text:
            p.seq, p.text_offset, p.attempt = seq, text_offset, attempt
        p.tokens.extend(token_ids)
        p.text.append(text)
        p.calls.append((len(token_ids), len(text)))
        if logprobs is not None:
            if p.logprobs is None:
                p.logprobs = []
            p.logprobs.extend(tuple(tuple(x) for x in lp) for lp in logprobs)  # in place: a lagging bus coalesces many steps
        self._kick(t)

    def final(self, key: str, topic: str, request_id: str, msg: Finished | Error,
              on_acked: Callable[[], None]) -> None:
        """Queue the closing reply; ``on_acked()`` runs once it (and all before it) is acknowledged."""
        t, p = self._pending(key, topic, request_id)
        p.final, p.on_acked = msg, on_acked
        self._closing.add(key)
        self._kick(t)

    def drop(self, key: str) -> None:
        """Forget request ``key``: nothing more of it is sent, and its ``on_acked`` never runs
        (partition revoked). A record of it already in flight still lands; consumers dedupe."""
        t = self._forget(key)
        if t is not None:
            t.queued.pop(key, None)

    def _forget(self, key: str) -> _Topic | None:
        self._closing.discard(key)
        self._partition.pop(key, None)
        return self._keys.pop(key, None)

    def _kick(self, t: _Topic) -> None:
        if t.task is None:
            t.task = asyncio.get_running_loop().create_task(self._pump(t), name=f"replies-{t.name}")
            self._tasks.add(t.task)
            t.task.add_done_callback(self._tasks.discard)

    async def _pump(self, t: _Topic) -> None:
        try:
            while t.queued:
                round_, t.queued = t.queued, {}
                try:
                    count = await self.topics.count(t.name)
                except Undeliverable as exc:
                    self._fail(t, list(round_), exc)
                    continue
                groups = self._groups(round_, count)
                if len(groups) == 1:
                    await self._send_group(t, *groups[0])
                else:
                    await asyncio.gather(*(self._send_group(t, part, items) for part, items in groups))
        finally:
            t.task = None
            if t.queued:  # cancelled mid-round (stop); nothing more is sent
                t.queued.clear()
            if self._topics.get(t.name) is t:
                del self._topics[t.name]

    def _groups(self, round_: dict[str, _Pending], count: int | None) -> list[tuple[int | None, list]]:
        """``round_`` as (partition, [(key, pending), ...]) per record to send. With the topic's
        partition count unknown, one record per request, keyed (the bus picks its partition)."""
        if count is None:
            return [(None, [item]) for item in round_.items()]
        groups: dict[int, list[tuple[str, _Pending]]] = {}
        for key, p in round_.items():
            part = self._partition.get(key)
            if part is None:
                part = self._partition[key] = partition_for_key(p.request_id.encode(), count)
            groups.setdefault(part, []).append((key, p))
        return list(groups.items())

    # -- reply topics (reply_topics.py), for the worker's intake and resume -------------------------

    def partition_count(self, topic: str) -> int | None:
        """``topic``'s partition count when cached (it existed when last asked), else None."""
        return self.topics.partition_count(topic)

    def known(self, topic: str) -> bool:
        """True when ``topic``'s partition count is cached: it existed when last asked."""
        return self.topics.known(topic)

    async def verify(self, topic: str) -> str | None:
        """:meth:`ReplyTopics.verify <engine_workers.worker.reply_topics.ReplyTopics.verify>`: None
        when ``topic`` exists (or the bus could not be asked), else the dead letter's reason."""
        return await self.topics.verify(topic)

    async def _send_group(self, t: _Topic, part: int | None, items: list[tuple[str, _Pending]]) -> None:
        """Send one partition's record of a round (several, in order, when it would pass
        ``max_record_bytes``: :mod:`~engine_workers.worker.replies.split`); never raises (but
        ``CancelledError``): a request whose record could not be sent is failed, the others of
        the round go on."""
        try:
            pieces = [Piece(c, tuple(p.calls)) for _, p in items if (c := p.take_chunk(self.worker_id)) is not None]
            pieces += [Piece(p.final) for _, p in items if p.final is not None]
            n = len(pieces)
            key = items[0][1].request_id.encode()  # every request here maps to ``part``
            for value in reply_records(pieces, self.max_record_bytes - RECORD_OVERHEAD - len(key)):
                try:
                    await self._send(t.name, value, key, part)
                except ValueError:  # the topic was re-created with fewer partitions: the count is stale
                    if part is None:
                        raise
                    self.topics.forget_count(t.name)
                    for k, _ in items:
                        self._partition.pop(k, None)
                    part = None
                    await self._send(t.name, value, key, None)  # keyed; later rounds use the new count
        except Exception as exc:  # BusError after the retries, or a bug: fail these requests
            self._fail(t, [k for k, _ in items], exc)
            return
        self.replies_sent += n
        for k, p in items:
            if p.final is not None and self._keys.get(k) is t:
                self._forget(k)
                self._call(p.on_acked)

    def _fail(self, t: _Topic, keys: list[str], exc: Exception) -> None:
        """Forget ``keys`` (what they still have queued too) and report each to ``on_failed``."""
        if isinstance(exc, Undeliverable):
            log.warning("replies of %s: %s; their requests are undeliverable", keys, exc)
            reason: str | None = str(exc)
        else:
            log.error("replies of %s to %s failed: %r", keys, t.name, exc, exc_info=not isinstance(exc, BusError))
            reason = None
        for k in keys:
            if self._keys.get(k) is t:
                self._forget(k)
                t.queued.pop(k, None)
                self._call(self.on_failed, k, reason)

    @staticmethod
    def _call(cb: Callable | None, *args: object) -> None:
        """A caller's callback; its exception is logged, so it cannot stop the round for the others."""
        if cb is None:
            return
        try:
            cb(*args)
        except Exception:
            log.exception("reply callback %r failed", cb)

    async def _send(self, topic: str, value: bytes, key: bytes, partition: int | None) -> None:
        backoff = 0.1
        for attempt in range(self.retries + 1):
            try:
                await self.bus.send(topic, value, key=key, partition=partition)
                self.records_sent += 1
                return
            except BusError:
                # Deleted since its count was cached? Then no retry can deliver (and the count goes).
                self.topics.forget_count(topic)
                with contextlib.suppress(BusError):  # the broker unreachable: retry as before
                    await self.topics.partitions(topic)  # raises Undeliverable when it is gone
                if attempt == self.retries:
                    raise
                await asyncio.sleep(backoff)
                backoff *= 2

    async def idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or in flight (or ``timeout_s``); True when idle."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._keys and loop.time() < deadline:
            await asyncio.sleep(0.005)
        return not self._keys

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._topics.clear()
        self._keys.clear()
        self._closing.clear()
        self._partition.clear()
        await self.topics.stop()
