"""The one lifecycle of a stream at the edge: registered at admission, ended exactly once, here.

A request admitted by :meth:`~edge.admission.gate.Admission.admit` becomes a :class:`Stream`,
registered with the :class:`Lifecycle` and owned by its handler's :class:`OwnedStreams` (an HTTP
request's, or a WebSocket connection's). From then on the lifecycle is the only code that counts
(TTFT, generated tokens, latencies, finish reasons, refusals) and the only code that ends a stream
(unregister, refund the unused tokens, end its span, publish a ``Cancel`` when asked). Every end
goes through :meth:`Lifecycle._end`, so a stream is released exactly once whichever comes first:

* the worker's ``Finished`` (:meth:`Lifecycle.finish`),
* an error: the worker's, the bus refusing the publish, the edge's deadline, a diverged re-run, or
  a sink that cannot keep up (:meth:`Lifecycle.fail`),
* the client: a cancel frame, or the handler leaving its ``with`` block, normally, by an
  exception or cancelled because the client went away (:meth:`Lifecycle.cancel`).

The request travels one way: route -> admission -> bus -> reply router -> lifecycle -> sink. A
sink (:class:`StreamSink`) only translates what it is handed into frames or SSE bytes: token
deltas (:meth:`StreamSink.on_delta`) and, once, the typed end (:class:`Done`, :class:`Failed` or
:class:`Cancelled`, :meth:`StreamSink.on_end`). It never calls back into admission; the one thing
it can say is that it cannot take more (``on_delta`` returns ``False``: a slow client), and the
lifecycle then fails the stream (``overloaded``, Cancel reason ``slow_client``).

Deltas are passed as arguments, not as an event object: they are the per-token hot path
(docs/benchmarks.md, Edge), and an object per token is measurable there. Ends are rare and typed.

Concurrency: everything runs on the edge's event loop, synchronously; nothing here awaits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from bus import ErrorCode, Finished, Timings
from edge.admission.auth import Principal
from edge.admission.ratelimit import RateLimiter
from edge.metrics import EdgeMetrics
from tracing import Span

SLOW_CLIENT = "client too slow: events not read"


@dataclass(frozen=True, slots=True)
class Done:
    """The worker finished the stream. ``ttft``/``e2e``: seconds from admission, at the edge."""

    finish_reason: str
    completion_tokens: int
    cached_tokens: int
    embedding: tuple[float, ...] | None
    timings: Timings  # the worker's own (queue, ttft, tpot)
    ttft: float | None
    e2e: float


@dataclass(frozen=True, slots=True)
class Failed:
    """The stream failed: ``code`` is an :class:`~bus.ErrorCode` value, the protocol-neutral
    vocabulary each front end maps once (WebSocket ``error`` frames, OpenAI's ``error_body``)."""

    code: str
    message: str
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The client ended the stream: ``reason`` ``client`` (a cancel frame) or ``disconnect``
    (its handler left with the stream still open)."""

    reason: str
    completion_tokens: int
    ttft: float | None
    e2e: float


End = Done | Failed | Cancelled


class StreamSink(Protocol):
    """Where a stream's output goes: the WebSocket :class:`~edge.ws.session.Session` or an OpenAI
    HTTP response's sink. Called on the event loop, synchronously; must not block (it queues, its
    own task writes to the client) and must not call back into admission."""

    def on_delta(self, s: Stream, seq: int, text: str, token_ids: tuple[int, ...],
                 logprobs: tuple | None) -> bool:
        """New output of ``s``. ``False``: the sink cannot take more (its client reads too slowly);
        the lifecycle then fails the stream."""
        ...

    def on_end(self, s: Stream, end: End) -> None:
        """``s`` ended (called exactly once, after it was released)."""
        ...


class Stream:
    """One request in flight: where its output goes and how far it got."""

    __slots__ = ("request_id", "client_id", "sink", "principal", "labels", "prompt_tokens", "max_tokens",
                 "charged", "next_seq", "chars", "admitted_at", "first_at", "deadline", "token_ids", "ended",
                 "delivered", "span", "attempt")

    def __init__(self, request_id: str, client_id: str, sink: StreamSink, principal: Principal,
                 labels: tuple[str, str, str], prompt_tokens: int, max_tokens: int, admitted_at: float,
                 deadline: float, token_ids: bool) -> None:
        self.request_id = request_id
        self.client_id = client_id
        self.sink = sink
        self.principal = principal
        self.labels = labels  # (model, tier, api) metric labels
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.charged = prompt_tokens + max_tokens
        self.next_seq = 0
        self.chars = 0
        # The highest attempt seen in its replies: a takeover after a worker failure replies with a
        # higher one, and replies of a lower (fenced) attempt are dropped (router.ReplyRouter).
        self.attempt = 0
        self.admitted_at = admitted_at  # loop time
        self.first_at: float | None = None
        self.deadline = deadline  # loop time
        self.token_ids = token_ids
        self.ended = False  # set once, by Lifecycle._end
        self.delivered: list[int] = []  # output token ids handed to the sink, by seq
        self.span: Span | None = None  # the request's edge span, only when tracing is on (Admission)


class OwnedStreams:
    """The streams one handler owns (an HTTP request's choices or inputs, a WebSocket
    connection's requests). Leaving its ``with`` block, however it is left, cancels every stream
    still open (reason ``disconnect``): the one place a handler's streams end when it goes away.

    Holds ended streams only until the next compaction (amortised O(1) per stream), so a
    long-lived connection does not accumulate them."""

    __slots__ = ("_lifecycle", "_streams", "_compact_at")

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle
        self._streams: list[Stream] = []
        self._compact_at = 16

    def add(self, s: Stream) -> None:
        if len(self._streams) >= self._compact_at:
            self._streams = [x for x in self._streams if not x.ended]
            self._compact_at = max(16, 2 * len(self._streams))
        self._streams.append(s)

    def open(self) -> list[Stream]:
        return [s for s in self._streams if not s.ended]

    def __enter__(self) -> OwnedStreams:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        streams, self._streams = self._streams, []
        for s in streams:
            self._lifecycle.cancel(s, "disconnect")


class Lifecycle:
    """The owner of every stream's counting and its one end. Built by
    :class:`~edge.admission.gate.Admission`; the reply router feeds it, sinks are fed by it.

    ``cancel``: queues a ``Cancel`` (request id, reason) for the workers (the admission's outbox)."""

    def __init__(self, metrics: EdgeMetrics, limiter: RateLimiter, cancel: Callable[[str, str], None]) -> None:
        self.metrics = metrics
        self.limiter = limiter
        self._cancel = cancel
        self.streams: dict[str, Stream] = {}  # request id -> stream, while it is open
        # The event loop's clock (the streams' admitted_at and deadlines), bound on the first
        # register: looking the loop up per token costs a system call on 3.11.
        self._now: Callable[[], float] = time.monotonic

    # --- start ----------------------------------------------------------------------------------
    def register(self, s: Stream, owner: OwnedStreams) -> None:
        """``s`` is open from now on: its replies are routed to it, ``owner`` ends it at the latest."""
        if not self.streams:
            self._now = asyncio.get_running_loop().time
        self.streams[s.request_id] = s
        owner.add(s)
        self.metrics.streams.inc()

    def get(self, request_id: str) -> Stream | None:
        return self.streams.get(request_id)

    # --- output ---------------------------------------------------------------------------------
    def delta(self, s: Stream, seq: int, text: str, token_ids: tuple[int, ...], logprobs: tuple | None) -> None:
        """New output of ``s`` (deduplicated by the router): counted (TTFT on the first), then handed
        to its sink."""
        m = self.metrics
        if s.first_at is None:
            s.first_at = now = self._now()
            m.per_request(s.labels)[0].observe(now - s.admitted_at)
        m.add_generated(s.labels, len(token_ids))
        if not s.sink.on_delta(s, seq, text, token_ids, logprobs):
            m.slow_disconnects.inc()
            self.fail(s, ErrorCode.OVERLOADED, SLOW_CLIENT, cancel="slow_client")

    # --- ends -----------------------------------------------------------------------------------
    def finish(self, s: Stream, msg: Finished) -> bool:
        """The worker's ``Finished``: latencies and the finish reason counted, ``s`` released."""
        if s.ended:
            return False
        now = self._now()
        self._count_end(s, msg.finish_reason, now)
        done = Done(msg.finish_reason, max(msg.num_tokens, s.next_seq), msg.usage.cached_tokens, msg.embedding,
                    msg.timings, self._ttft(s), now - s.admitted_at)
        return self._end(s, done, None)

    def fail(self, s: Stream, code: str, message: str, retry_after: float | None = None, *,
             cancel: str | None = None, why: str | None = None) -> bool:
        """End ``s`` with an error (counted as a refusal with ``code``); ``cancel``: also tell the
        workers to stop it, with that reason; ``why``: the span's error text (default
        ``"<code>: <message>"``). ``False`` if it had already ended."""
        if s.ended:
            return False
        self.metrics.rejections.labels(code, s.labels[2]).inc()
        if s.span is not None:
            s.span.fail(why if why is not None else f"{code}: {message}")
        return self._end(s, Failed(code, message, retry_after), cancel)

    def cancel(self, s: Stream, reason: str) -> bool:
        """The client ended ``s`` (``client``: it asked; ``disconnect``: it went away): counted as
        ``abort``, the workers told to stop it. ``False`` if it had already ended."""
        if s.ended:
            return False
        now = self._now()
        self._count_end(s, "abort", now)
        return self._end(s, Cancelled(reason, s.next_seq, self._ttft(s), now - s.admitted_at), reason)

    def expire(self, now: float) -> None:
        """Fail every stream past its deadline (loop time ``now``) with ``expired`` and cancel it on
        its worker."""
        for s in [s for s in self.streams.values() if now > s.deadline]:
            self.fail(s, ErrorCode.EXPIRED, "no reply before the request deadline", cancel="expired")

    # --- internals ------------------------------------------------------------------------------
    def _ttft(self, s: Stream) -> float | None:
        return s.first_at - s.admitted_at if s.first_at is not None else None

    def _count_end(self, s: Stream, finish_reason: str, now: float) -> None:
        m = self.metrics
        if finish_reason != "abort":
            _, e2e, tpot, _ = m.per_request(s.labels)
            e2e.observe(now - s.admitted_at)
            if s.first_at is not None and s.next_seq > 1:
                tpot.observe((now - s.first_at) / (s.next_seq - 1))
        m.success.labels(*s.labels, finish_reason).inc()
        if s.span is not None:
            s.span.set("gen_ai.response.finish_reasons", finish_reason)

    def _end(self, s: Stream, end: End, cancel_reason: str | None) -> bool:
        """The one release: unregister ``s``, free its stream slot, refund the tokens it did not
        use, publish a Cancel when ``cancel_reason`` is given, end its span; then its sink learns
        how it ended."""
        s.ended = True
        self.streams.pop(s.request_id, None)
        self.metrics.streams.dec()
        used = s.next_seq
        self.limiter.release(s.principal.entry, max(0, s.max_tokens - used), time.monotonic())
        if cancel_reason is not None:
            self._cancel(s.request_id, cancel_reason)
        if s.span is not None:
            s.span.set("gen_ai.usage.output_tokens", used)
            s.span.set("lockgate.cancel_reason", cancel_reason)
            s.span.end()
        s.sink.on_end(s, end)
        return True
