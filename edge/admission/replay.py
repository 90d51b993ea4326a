"""A request's output read back from its reply topic, by any edge: what makes a stream resumable.

A worker publishes a request's replies, in order, on the reply topic the request names (the
admitting edge's ``<ns>.reply.<edge id>``), and the topic keeps them for its retention. So any edge
(the one that admitted the request, another one, one started after the first died) can rebuild the
request's output from the start: a :class:`Replay` reads the topic from the request's admission
time (:class:`ReplyOrigin`), keeps the replies of that request, deduplicates them exactly as the
live path does (:func:`edge.admission.router.dedupe`: a re-run after a worker failure shows up
once) and hands them to a :class:`~edge.admission.lifecycle.StreamSink`, the same sink the live
path feeds. Same records, same order, same dedupe, same sink: the same events, byte for byte. The
caller (a resume handler) writes only the events after the position its client already has.

A replayed stream is *detached*: it is not registered with the lifecycle (not counted twice, no
rate-limit charge, no Cancel when the reader goes away: reading a response never stops it).

The topic is read group-less, every partition from ``since_ms``; records of other requests are
decoded and skipped (the cost of a resume grows with the reply traffic of the admitting edge since
the request began: docs/benchmarks.md, "Resume"). Concurrency: one task owns a :class:`Replay`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from bus import Bus, Consumer, DecodeError, Error, Finished, TokenChunk
from edge.admission.auth import Principal
from edge.admission.lifecycle import Done, End, Failed, Stream, StreamSink
from edge.admission.router import SpliceMismatch, checkpoint, decode_reply, dedupe
from edge.config import KeyEntry

# Replies are stamped by the worker's clock, the origin by the edge's: reading from this much
# earlier keeps a request's first replies even when the worker's clock is behind the edge's.
CLOCK_SKEW_MS = 10_000
POLL_MS = 100
_DETACHED = Principal(KeyEntry("0" * 64, "replay", 1, 0, 0, 0))


@dataclass(frozen=True, slots=True)
class ReplyOrigin:
    """Where a request's replies are: its ``topic`` (the request's ``reply_to``) from ``since_ms``
    (wall-clock ms, at or before its first reply)."""

    request_id: str
    topic: str
    since_ms: int


def detached_stream(request_id: str, sink: StreamSink, prompt_tokens: int, max_tokens: int = 0) -> Stream:
    """A :class:`Stream` for a replay: the dedupe state and what the sinks read, nothing registered."""
    now = time.monotonic()
    return Stream(request_id, "", sink, _DETACHED, ("", "", "replay"), prompt_tokens, max_tokens, now, now, False)


class Replay:
    """Feeds ``stream.sink`` with the request's replies read from ``origin``. Use as ``async with``;
    call :meth:`advance` until it answers ``False``."""

    def __init__(self, bus: Bus, origin: ReplyOrigin, stream: Stream) -> None:
        self.bus = bus
        self.origin = origin
        self.stream = stream
        self.ended: End | None = None
        self._consumer: Consumer | None = None

    async def __aenter__(self) -> Replay:
        start = max(0, self.origin.since_ms - CLOCK_SKEW_MS)
        self._consumer = self.bus.consumer([self.origin.topic], group_id=None, start_from=start)
        await self._consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def advance(self, live: bool) -> bool:
        """Read what the topic has now and feed the sink. ``True``: more may come (call again);
        ``False``: the request ended (:attr:`ended`) or, with ``live`` false, the replay caught up
        with the topic's end (a snapshot of the output so far)."""
        consumer = self._consumer
        assert consumer is not None, "use Replay as `async with`"
        records = await consumer.getmany(timeout_ms=POLL_MS, max_records=4096)
        checkpoint()
        rid = self.origin.request_id
        for rec in records:
            try:
                msgs = decode_reply(rec.value)
            except DecodeError:
                continue  # the live router counts and logs it; a replay skips it the same way
            for msg in msgs:
                if getattr(msg, "request_id", None) != rid:
                    continue
                self._feed(msg)
                if self.ended is not None:
                    return False
        if not live and not records:
            return any((await consumer.lag()).values())
        return True

    def _feed(self, msg: object) -> None:
        s = self.stream
        if isinstance(msg, TokenChunk):
            try:
                new = dedupe(s, msg)
            except SpliceMismatch:
                self._end(Failed("internal", "the request was re-run after a worker failure and its output "
                                             "diverged from the tokens already sent; retry the request", 0.0))
                return
            if new is not None:
                if s.first_at is None:
                    s.first_at = time.monotonic()
                s.sink.on_delta(s, *new)  # a replay's reader paces itself: never "too slow"
        elif isinstance(msg, Finished):
            self._end(Done(msg.finish_reason, max(msg.num_tokens, s.next_seq), msg.usage.cached_tokens, msg.embedding,
                           msg.timings, None, 0.0))
        elif isinstance(msg, Error):
            self._end(Failed(msg.code, msg.message, msg.retry_after))

    def _end(self, end: End) -> None:
        self.ended = end
        self.stream.ended = True
        self.stream.sink.on_end(self.stream, end)


async def snapshot(bus: Bus, origin: ReplyOrigin, stream: Stream, timeout_s: float) -> End | None:
    """Feed ``stream.sink`` everything the topic holds of the request now; its end when it ended.
    Raises ``TimeoutError`` past ``timeout_s``."""
    async with asyncio.timeout(timeout_s), Replay(bus, origin, stream) as r:
        while await r.advance(live=False):
            pass
        return r.ended
