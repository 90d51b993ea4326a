"""One WebSocket connection: reads client frames, admits requests, writes server frames.

Concurrency contract:

* :meth:`Session.run` is the connection handler; it owns the writer task (created on the first
  frame that cannot take the fast path, so an idle or fast connection has none) and reads frames in
  order. A ``generate`` is admitted (validated, tokenized, charged, published) before the next frame
  is read, so frames of one connection are handled in order.
* The session is its streams' :class:`~edge.admission.lifecycle.StreamSink`: what the lifecycle
  hands it (``on_delta``, ``on_end``) it only turns into frames, synchronously, never blocking, and
  never calling back into admission (counting and releasing are the lifecycle's). A plain token
  delta (no token ids or logprobs asked for) with nothing pending, queued or
  being written is framed and written to the socket at once, from ``on_delta``: in a worker step's
  burst the first clients get their token while the router is still routing the rest. Any other
  outbound frame of one event-loop tick collects in a pending list; the edge's
  :class:`TickFlusher` (one ``call_soon`` per tick for all sessions) then flushes each session,
  which either writes them straight to the socket (fast path: nothing queued, no write in
  progress, the transport's buffer empty — one ``transport.write`` for all of them) or
  appends them to the bounded send queue (``send_queue_frames`` items) that the writer task drains
  with flow control. Frames keep their order on both paths: the fast path is only taken while the
  queue is empty and the writer idle.
* Slow-client policy: the connection is closed with 1008 ("client too slow") when the send queue is
  full, or when one write to the socket has been blocked for more than ``slow_client_grace_s``
  (checked by the edge's sweep, every 0.25 s); a client that does not take the close frame within
  ``close_timeout_s`` has its TCP connection aborted. Its requests are cancelled. Nothing is buffered
  beyond the queue and the socket's write buffer (websockets' ``write_limit``).
* :meth:`run` owns the connection's streams (:class:`~edge.admission.lifecycle.OwnedStreams`): when
  it returns (client gone, closed, or the task cancelled), every request still in flight is
  cancelled by the lifecycle (a :class:`~bus.messages.Cancel`, reason ``disconnect``) — except
  resumable ones (``"resumable": true``), owned by the admission's ``resumables``: they run on, and
  their client picks them up again with a ``resume`` frame, on any edge (:meth:`Session.resume`: a
  replay from the reply topic, :mod:`edge.admission.replay`, in a task this session owns).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from bus import BusError, ErrorCode, InferenceRequest
from edge.admission.auth import Principal
from edge.admission.gate import Admission
from edge.admission.lifecycle import Cancelled, Done, End, Failed, Stream
from edge.admission.replay import Replay, ReplyOrigin, detached_stream
from edge.admission.resumable import ResumableStream
from edge.request import Generate, ProtocolError
from edge.ws.protocol import (
    CancelFrame,
    ResumeFrame,
    accepted_frame,
    delta_frame,
    done_frame,
    error_frame,
    parse_client_frame,
    refusal_frame,
)

log = logging.getLogger(__name__)

CLOSE_SLOW = 1008
MAX_COALESCE = 512


def _round(seconds: float | None) -> float | None:
    return round(seconds, 6) if seconds is not None else None


def text_frames(payloads: list[bytes] | tuple[bytes, ...]) -> bytes:
    """Unmasked, unfragmented server text frames (RFC 6455 section 5.2) for ``payloads``.

    The fast path's framing: websockets' ``send_text`` + ``data_to_send`` build a ``Frame`` object
    and go through its extension pipeline per frame, a sizeable share of what a token costs the edge
    (figures in docs/benchmarks.md, Edge).
    Valid only while the connection is OPEN, no extension is negotiated (the edge serves with
    ``compression=None``) and no fragmented message is in progress (the edge never fragments):
    then a frame is just FIN|opcode, the length, the payload, and websockets' protocol state does
    not depend on data frames it did not build. Its own control frames (pings, close) are written
    to the same transport from the same thread, so frames never interleave."""
    if len(payloads) == 1 and len(payloads[0]) < 126:  # one token's delta: no bytearray round trip
        return b"\x81" + bytes((len(payloads[0]),)) + payloads[0]
    out = bytearray()
    for p in payloads:
        n = len(p)
        if n < 126:
            out += b"\x81" + n.to_bytes(1, "big")
        elif n < 65536:
            out += b"\x81\x7e" + n.to_bytes(2, "big")
        else:
            out += b"\x81\x7f" + n.to_bytes(8, "big")
        out += p
    return bytes(out)


class _Delta:
    __slots__ = ("id", "seq", "text", "token_ids", "logprobs")

    def __init__(self, id: str, seq: int, text: str, token_ids: list | None, logprobs: list | None) -> None:
        self.id, self.seq, self.text, self.token_ids, self.logprobs = id, seq, text, token_ids, logprobs


def coalesce(items: list) -> list[bytes]:
    """Merge consecutive deltas of one request into one frame (fewer, larger frames under load)."""
    out: list[bytes] = []
    cur: _Delta | None = None
    for it in items:
        if isinstance(it, _Delta):
            if cur is not None and cur.id == it.id:
                cur.text += it.text
                if cur.token_ids is not None and it.token_ids is not None:
                    cur.token_ids.extend(it.token_ids)
                if cur.logprobs is not None and it.logprobs is not None:
                    cur.logprobs.extend(it.logprobs)
                continue
            if cur is not None:
                out.append(delta_frame(cur.id, cur.seq, cur.text, cur.token_ids, cur.logprobs))
            cur = it
        else:
            if cur is not None:
                out.append(delta_frame(cur.id, cur.seq, cur.text, cur.token_ids, cur.logprobs))
                cur = None
            out.append(it)
    if cur is not None:
        out.append(delta_frame(cur.id, cur.seq, cur.text, cur.token_ids, cur.logprobs))
    return out


class TickFlusher:
    """Flushes, once per event-loop tick, every session that queued frames in it: one
    ``call_soon`` for all of them instead of one per session (a worker step's burst touches every
    streaming session: one handle allocated and dispatched by the loop per session per tick).

    Contract: :meth:`add` is called by a session when its pending list goes from empty to
    non-empty, so a session is listed at most once per tick; :meth:`run` flushes them in the order
    they were added. One session's failure is logged and kills that session only."""

    __slots__ = ("_loop", "_dirty")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dirty: list[Session] = []

    def add(self, session: Session) -> None:
        if not self._dirty:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self.run)
        self._dirty.append(session)

    def run(self) -> None:
        dirty, self._dirty = self._dirty, []
        for s in dirty:
            try:
                s._flush()
            except Exception:
                log.exception("flushing frames to client %s failed", s.principal.tenant)
                s._pending = None
                s.kill(1011, "internal error")


class _Resumed:
    """The sink of a resumed stream: the session's, less the deltas its client already has (those
    before output index ``start``; the replay's deltas end where the live ones did, so ``start``
    falls between two of them)."""

    __slots__ = ("session", "start")

    def __init__(self, session: Session, start: int) -> None:
        self.session, self.start = session, start

    def on_delta(self, s: Stream, seq: int, text: str, token_ids: tuple, logprobs: tuple | None) -> bool:
        if seq < self.start:
            return True
        return self.session.on_delta(s, seq, text, token_ids, logprobs)

    def on_end(self, s: Stream, end: End) -> None:
        self.session.on_end(s, end)


class Session:
    def __init__(self, admission: Admission, flusher: TickFlusher, ws: Any, principal: Principal) -> None:
        self.adm = admission
        self.flusher = flusher
        self.ws = ws
        self.principal = principal
        self.queue: asyncio.Queue | None = None  # created with the writer, on first use
        self._writer_task: asyncio.Task | None = None
        self._ended = False  # run() has finished: nothing is written any more
        self.streams: dict[str, Stream] = {}  # client id -> stream, while it is open
        self._owned = admission.streams()  # ends, in run(), whatever is still open when the connection ends
        self._replays: set[asyncio.Task] = set()  # resumed streams' replays, cancelled when run() ends
        self.send_since: float | None = None  # loop time the current socket write started
        self.closing = False
        self._close_task: asyncio.Task | None = None
        self._pending: list | None = None  # frames of this tick, not yet flushed
        self._loop = asyncio.get_running_loop()
        # The upgrade request's traceparent: every request of the connection joins that trace
        # (None: tracing off, or no valid header; each request then starts its own trace).
        request = getattr(ws, "request", None)
        self.trace_parent = admission.trace_parent(request.headers) if request is not None else None

    # --- outbound -----------------------------------------------------------------------------
    def push(self, item: bytes | _Delta) -> bool:
        """Queue ``item`` for the client (flushed at the end of this tick). ``False`` once closing."""
        if self.closing:
            return False
        if self._pending is None:
            self._pending = [item]
            self.flusher.add(self)
        else:
            self._pending.append(item)
        return True

    def _direct(self) -> bool:
        """Whether a frame may go straight to the socket: open, nothing queued or being sent, no
        extension, and the socket took everything so far (so one tick's frames are the most this
        can add to its buffer; the next tick sees a non-empty buffer and queues instead)."""
        ws = self.ws
        transport = ws.transport
        return (not self.closing and not self._ended and (self.queue is None or self.queue.empty())
                and self.send_since is None and ws.protocol.state is State.OPEN and not ws.protocol.extensions
                and not transport.is_closing() and transport.get_write_buffer_size() == 0)

    def _write(self, data: bytes) -> None:
        try:
            self.ws.transport.write(data)
        except Exception as exc:  # the socket is failing; websockets' reader will see it too
            log.info("write to client %s failed: %s", self.principal.tenant, exc)
            self.kill(1011, "write failed")

    def _flush(self) -> None:
        items, self._pending = self._pending, None
        if not items or self._ended:
            return
        if self._direct():
            if len(items) == 1 and items[0].__class__ is _Delta:  # one token
                d = items[0]
                self._write(text_frames((delta_frame(d.id, d.seq, d.text, d.token_ids, d.logprobs),)))
            else:
                self._write(text_frames(coalesce(items)))
            return
        for item in items:
            if not self._enqueue(item):
                return

    def _enqueue(self, item: bytes | _Delta) -> bool:
        if self.queue is None:
            self.queue = asyncio.Queue(self.adm.config.send_queue_frames)
            self._writer_task = self._loop.create_task(self._writer())
        try:
            self.queue.put_nowait(item)
            return True
        except asyncio.QueueFull:
            self.kill(CLOSE_SLOW, "client too slow: send queue full")
            return False

    def kill(self, code: int, reason: str) -> None:
        """Close the connection soon (non-blocking). The handler ends and cancels its requests."""
        if self.closing:
            return
        self.closing = True
        if code == CLOSE_SLOW:
            self.adm.metrics.slow_disconnects.inc()
            log.info("closing slow client %s (%s)", self.principal.tenant, reason)
        self._close_task = self._loop.create_task(self._close(code, reason))

    async def _close(self, code: int, reason: str) -> None:
        """The closing handshake, bounded by ``close_timeout_s``. websockets' ``close()`` first
        drains the socket's write buffer, which never ends for a client that stopped reading (its
        own ``close_timeout`` only starts after that drain), so past the bound the TCP connection is
        aborted. Either way :meth:`run`'s read loop then ends and cancels the requests."""
        close = asyncio.ensure_future(self.ws.close(code, reason))
        # asyncio.wait, not wait_for: see edge.admission.router.checkpoint for 3.11's wait_for race.
        done, _ = await asyncio.wait({close}, timeout=self.adm.config.close_timeout_s)
        if not done:
            self.ws.transport.abort()
        await asyncio.gather(close, return_exceptions=True)

    async def _writer(self) -> None:
        q, ws, loop = self.queue, self.ws, self._loop
        assert q is not None  # _enqueue creates the queue before it starts this task
        while True:
            items = [await q.get()]
            while not q.empty() and len(items) < MAX_COALESCE:
                items.append(q.get_nowait())
            for frame in coalesce(items):
                self.send_since = loop.time()
                await ws.send(frame, text=True)
                self.send_since = None

    # --- the sink: lifecycle events -> frames (sync, never block) ------------------------------
    def on_delta(self, s: Stream, seq: int, text: str, token_ids: tuple, logprobs: tuple | None) -> bool:
        if logprobs is None and not s.token_ids and self._pending is None and self._direct():
            # The common case, a plain delta with nothing ahead of it: framed and written now,
            # without the tick's pending list (which exists to merge what queues up behind).
            self._write(text_frames((delta_frame(s.client_id, seq, text, None, None),)))
            return True
        lp = [[list(p) for p in pos] for pos in logprobs] if logprobs is not None else None
        self.push(_Delta(s.client_id, seq, text, list(token_ids) if s.token_ids else None, lp))
        return True  # a slow connection is closed as a whole (kill), never one stream of it

    def on_end(self, s: Stream, end: End) -> None:
        if self.streams.get(s.client_id) is s:
            del self.streams[s.client_id]
        if isinstance(end, Done):
            usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": end.completion_tokens,
                     "cached_tokens": end.cached_tokens}
            timings = {"ttft": _round(end.ttft), "e2e": round(end.e2e, 6), "queue": end.timings.queue,
                       "worker_ttft": end.timings.ttft, "tpot": end.timings.tpot}
            self.push(done_frame(s.client_id, s.request_id, end.finish_reason, usage, timings))
        elif isinstance(end, Failed):
            self.push(error_frame(end.code, end.message, id=s.client_id, request_id=s.request_id,
                                  retry_after=end.retry_after))
        elif isinstance(end, Cancelled) and end.reason == "client":  # a disconnected client gets nothing
            usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": end.completion_tokens, "cached_tokens": 0}
            timings = {"ttft": _round(end.ttft), "e2e": round(end.e2e, 6)}
            self.push(done_frame(s.client_id, s.request_id, "abort", usage, timings))

    # --- inbound ------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            with self._owned:  # leaving it cancels every request still in flight (disconnect)
                try:
                    async for message in self.ws:
                        if self.closing:
                            break
                        await self.on_frame(message)
                except ConnectionClosed:
                    pass
                finally:
                    self.closing = self._ended = True
                    if self._writer_task is not None:
                        self._writer_task.cancel()
        finally:
            for t in self._replays:
                t.cancel()
            await asyncio.gather(*self._replays, return_exceptions=True)
            if self._writer_task is not None:
                await asyncio.gather(self._writer_task, return_exceptions=True)
            if self._close_task is not None:
                await asyncio.gather(self._close_task, return_exceptions=True)

    async def on_frame(self, message: str | bytes) -> None:
        try:
            frame = parse_client_frame(message, self.adm.config.default_max_tokens)
            if isinstance(frame, Generate):
                await self.generate(frame)
            elif isinstance(frame, ResumeFrame):
                await self.resume(frame)
            else:
                self.cancel(frame)
        except ProtocolError as exc:
            self.adm.reject(exc.code, "ws")
            self.push(refusal_frame(exc))

    def cancel(self, frame: CancelFrame) -> None:
        s = self.streams.get(frame.id) if frame.id else None
        if s is None and frame.request_id:
            s = next((x for x in self.streams.values() if x.request_id == frame.request_id), None)
        if s is None:
            raise ProtocolError("no request in flight with that id", "request_id" if frame.request_id else "id",
                                frame.id)
        if self.adm.lifecycle.get(s.request_id) is not s:  # resumed here: the workers' abort ends its replay
            self.adm.publish_cancel(s.request_id, "client")
            return
        self.adm.lifecycle.cancel(s, "client")  # its done frame comes back through on_end

    async def generate(self, g: Generate) -> None:
        cfg = self.adm.config
        if g.id in self.streams:
            raise ProtocolError("a request with this id is already in flight on this connection", "id", g.id)
        if len(self.streams) >= cfg.max_streams_per_connection:
            raise ProtocolError(f"{len(self.streams)} requests in flight on this connection, at most "
                                f"{cfg.max_streams_per_connection}", "max_streams_per_connection", g.id,
                                code=ErrorCode.RATE_LIMITED, retry_after=1.0)
        owner = self.adm.resumables if g.resumable else self._owned
        admitted = await self.adm.admit(g, self.principal, self, "ws", owner, token_ids=g.token_ids,
                                        gone=lambda: self.closing, trace_parent=self.trace_parent)
        if admitted is None:
            return
        s = admitted.stream
        self.streams[g.id] = s
        self.push(accepted_frame(g.id, s.request_id, s.prompt_tokens, s.max_tokens, admitted.request.sampling.seed))
        if not g.resumable:
            await self.adm.publish(admitted)
            return
        # its record (where any edge finds it) is written along with the publish
        put = asyncio.ensure_future(self._record(admitted.request, s))
        try:
            await self.adm.publish(admitted)
        finally:
            await put

    async def _record(self, req: InferenceRequest, s: Stream) -> None:
        directory = self.adm.directory
        if directory is None:
            return
        rec = ResumableStream(self.principal.entry.key_hash, ReplyOrigin(req.request_id, req.reply_to,
                                                                         int(req.enqueued_at * 1000)),
                              s.prompt_tokens, s.max_tokens)
        try:
            async with asyncio.timeout(self.adm.config.publish_timeout_s):
                await directory.put(rec)
        except (BusError, TimeoutError) as exc:  # it runs, but cannot be resumed on another edge
            log.warning("recording resumable request %s failed: %s", req.request_id, exc)

    async def resume(self, f: ResumeFrame) -> None:
        """Continue the resumable request ``f.request_id`` (this key's, admitted by any edge) from
        output index ``f.seq``: replayed from its reply topic, then live, as client id ``f.id``."""
        cfg = self.adm.config
        if f.id in self.streams:
            raise ProtocolError("a request with this id is already in flight on this connection", "id", f.id)
        if len(self.streams) >= cfg.max_streams_per_connection:
            raise ProtocolError(f"{len(self.streams)} requests in flight on this connection, at most "
                                f"{cfg.max_streams_per_connection}", "max_streams_per_connection", f.id,
                                code=ErrorCode.RATE_LIMITED, retry_after=1.0)
        directory = self.adm.directory
        try:
            rec = await directory.get(self.principal.entry.key_hash, f.request_id) if directory is not None else None
        except BusError as exc:
            raise ProtocolError(f"the stream directory is unreachable: {exc}", None, f.id,
                                code=ErrorCode.OVERLOADED, retry_after=1.0) from None
        if rec is None:
            raise ProtocolError("no resumable request with that request_id", "request_id", f.id, code="not_found")
        s = detached_stream(f.request_id, _Resumed(self, f.seq), rec.prompt_tokens, rec.max_tokens)
        s.client_id, s.token_ids = f.id, True
        self.streams[f.id] = s
        task = self._loop.create_task(self._replay(rec.origin, s))
        self._replays.add(task)
        task.add_done_callback(self._replays.discard)

    async def _replay(self, origin: ReplyOrigin, s: Stream) -> None:
        deadline = self._loop.time() + self.adm.config.request_timeout_s
        try:
            async with Replay(self.adm.bus, origin, s) as r:
                while await r.advance(live=True):
                    if self.closing:
                        return
                    if self._loop.time() > deadline:
                        self.on_end(s, Failed(ErrorCode.EXPIRED, "no end of the request before the deadline"))
                        return
        except BusError as exc:
            self.on_end(s, Failed(ErrorCode.OVERLOADED, f"the reply topic could not be read: {exc}", 1.0))
