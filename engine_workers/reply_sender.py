"""Ordered, coalescing reply publishing for the worker: one stream of records per request.

The engine's outputs arrive on the event loop once per step; publishing must neither block the
engine nor reorder a request's records. ``ReplySender`` keeps one outbox per request: ``chunk``
appends tokens to it, ``final`` puts the closing ``Finished``/``Error`` behind them, and one task
per request with something to send (created on demand, ended when its outbox is empty) awaits each
send in order. While a send is in flight, the next steps' tokens of that request accumulate and go
out as one ``TokenChunk`` (``seq`` = index of its first token), so a slow bus costs fewer, larger
records rather than a backlog. Different requests send concurrently.

Failure: a send is retried ``retries`` times (backoff 0.1 s doubling); then the outbox is dropped and
``on_failed(key)`` is called (the worker leaves the request uncommitted, so it runs again elsewhere).

Concurrency: ``chunk``/``final``/``drop`` are synchronous and called from the event loop only.
Memory: an outbox holds at most the tokens of one request not yet sent. ``stop`` cancels every
task (records not yet sent are lost, as in a crash: their requests are uncommitted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from bus.base import Bus, BusError
from bus.messages import TokenChunk, encode

log = logging.getLogger(__name__)


class _Outbox:
    __slots__ = ("topic", "request_id", "attempt", "seq", "tokens", "text", "text_offset", "logprobs", "final",
                 "on_acked", "task")

    def __init__(self, topic: str, request_id: str) -> None:
        self.topic = topic
        self.request_id = request_id
        self.attempt = 0
        self.seq = -1  # index of tokens[0]
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.text_offset = 0
        self.logprobs: list | None = None
        self.final: bytes | None = None
        self.on_acked: Callable[[], None] | None = None
        self.task: asyncio.Task | None = None

    def take_chunk(self, worker_id: str) -> TokenChunk | None:
        if not self.tokens and not self.text:
            return None
        chunk = TokenChunk(self.request_id, self.attempt, self.seq, tuple(self.tokens), "".join(self.text),
                           self.text_offset, tuple(self.logprobs) if self.logprobs is not None else None, worker_id)
        self.tokens, self.text, self.logprobs, self.seq = [], [], None, -1
        return chunk


class ReplySender:
    def __init__(self, bus: Bus, worker_id: str, retries: int = 3,
                 on_failed: Callable[[str], None] | None = None) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.retries = retries
        self.on_failed = on_failed
        self._boxes: dict[str, _Outbox] = {}
        self._tasks: set[asyncio.Task] = set()
        self.records_sent = 0

    def __len__(self) -> int:
        return len(self._boxes)

    def _box(self, key: str, topic: str, request_id: str) -> _Outbox:
        box = self._boxes.get(key)
        if box is None:
            box = self._boxes[key] = _Outbox(topic, request_id)
        return box

    def chunk(self, key: str, topic: str, request_id: str, attempt: int, seq: int, token_ids, text: str,
              text_offset: int, logprobs=None) -> None:
        """Queue tokens ``seq..`` of request ``key`` (contiguous with what is queued)."""
        box = self._box(key, topic, request_id)
        if box.final is not None:
            raise RuntimeError(f"{key}: chunk after final")
        if not box.tokens and not box.text:
            box.seq, box.text_offset, box.attempt = seq, text_offset, attempt
        box.tokens.extend(token_ids)
        box.text.append(text)
        if logprobs is not None:
            box.logprobs = (box.logprobs or []) + [tuple(tuple(x) for x in lp) for lp in logprobs]
        self._kick(key, box)

    def final(self, key: str, topic: str, request_id: str, record: bytes, on_acked: Callable[[], None]) -> None:
        """Queue the closing record; ``on_acked()`` runs once it (and all before it) is acknowledged."""
        box = self._box(key, topic, request_id)
        box.final, box.on_acked = record, on_acked
        self._kick(key, box)

    def drop(self, key: str) -> None:
        """Forget request ``key``: nothing more of it is sent (partition revoked)."""
        box = self._boxes.pop(key, None)
        if box is not None and box.task is not None:
            box.task.cancel()

    def _kick(self, key: str, box: _Outbox) -> None:
        if box.task is None:
            box.task = asyncio.get_running_loop().create_task(self._pump(key, box), name=f"reply-{key}")
            self._tasks.add(box.task)
            box.task.add_done_callback(self._tasks.discard)

    async def _pump(self, key: str, box: _Outbox) -> None:
        try:
            while self._boxes.get(key) is box:
                chunk = box.take_chunk(self.worker_id)
                if chunk is not None:
                    await self._send(box.topic, box.request_id, encode(chunk))
                elif box.final is not None:
                    await self._send(box.topic, box.request_id, box.final)
                    del self._boxes[key]
                    if box.on_acked is not None:
                        box.on_acked()
                    return
                else:
                    return
        except BusError as exc:
            log.error("replies of %s to %s failed: %s", key, box.topic, exc)
            self._boxes.pop(key, None)
            if self.on_failed is not None:
                self.on_failed(key)
        finally:
            box.task = None

    async def _send(self, topic: str, request_id: str, value: bytes) -> None:
        backoff = 0.1
        for attempt in range(self.retries + 1):
            try:
                await self.bus.send(topic, value, key=request_id.encode())
                self.records_sent += 1
                return
            except BusError:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(backoff)
                backoff *= 2

    async def idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued (or ``timeout_s``); True when idle."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._boxes and loop.time() < deadline:
            await asyncio.sleep(0.005)
        return not self._boxes

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._boxes.clear()
