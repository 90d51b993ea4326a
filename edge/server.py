"""The edge: WebSocket + HTTP server in front of the bus. Embeddable: ``Edge(config, bus)``.

Lifecycle: ``await edge.start()`` (or ``async with edge``) creates the topics it needs, starts the
reply router, the heartbeat reader, the cancel publisher and the sweep, then listens;
``await edge.stop()`` stops listening, closes every connection with 1001 (their requests are
cancelled on the bus) and stops the background tasks. Both are idempotent. The bus belongs to the
caller: it must be started before ``start()`` and is left running by ``stop()``, so one bus can be
shared with workers in the same process.

Every background task is created and owned here and awaited in ``stop()``. Every queue is bounded:
per-session send queues (``send_queue_frames``) and the cancel outbox (``CANCEL_OUTBOX``).

HTTP on the same port (``process_request``): ``/healthz``, ``/readyz``, ``/metrics``, ``/``. A
WebSocket handshake on ``/`` or ``/ws`` is authenticated here (401), shed (503) or accepted.

With ``config.openai_port`` set, the OpenAI-compatible HTTP API (:mod:`edge.openai.routes`) listens
on that port too, on the same event loop, with the Anthropic Messages API (:mod:`edge.anthropic.routes`)
added to the same application (one ``base_url`` for both SDKs). Every API admits through one
:class:`~edge.admission.gate.Admission` (keys, limits, shedding, metrics, the cancel outbox).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from bus import Bus, CompactedTable, DecodeError, WorkerStatus, decode
from edge.admission.auth import AuthError, Principal, extract_key, select_subprotocol
from edge.admission.fleetsync import FleetSync
from edge.admission.gate import Admission
from edge.admission.resumable import StreamDirectory
from edge.admission.router import checkpoint
from edge.anthropic.routes import MessagesRoutes
from edge.config import EdgeConfig
from edge.metrics import CONTENT_TYPE, EdgeMetrics
from edge.openai.responses.store import ResponseStore
from edge.openai.routes import OpenAIServer
from edge.request import PromptEncoder
from edge.ws.session import Session, TickFlusher
from tracing import Tracer

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "ws" / "static"
SWEEP_INTERVAL_S = 0.25
FLEET_START_WAIT_S = 10.0  # the longest start() waits for the edge's first fleet heartbeat to come back
WS_PATHS = ("/", "/ws")


class Edge:
    def __init__(self, config: EdgeConfig, bus: Bus, encoder: PromptEncoder | None = None,
                 tracer: Tracer | None = None) -> None:
        self.config = config
        self.bus = bus
        self.metrics = EdgeMetrics()
        self.reply_topic = config.layout.reply_topic(config.edge_id)
        # Both APIs admit through this one object (keys, limits, shedding, publish, cancel).
        self.admission = Admission(config, bus, encoder, self.metrics, self.reply_topic, tracer)
        self.limiter = self.admission.limiter
        self.shedder = self.admission.shedder
        self.auth = self.admission.auth
        self.router = self.admission.router
        # fleet-wide key limits (edge/admission/fleet.py); None in dev mode or with them off
        self.fleet = FleetSync(bus, config.layout, self.limiter, config.fleet_sync_interval_s,
                               config.publish_timeout_s) if self.limiter.fleet is not None else None
        self.openai: OpenAIServer | None = None
        self.table: CompactedTable | None = None  # the fleet's stored responses (with the OpenAI API)
        self.sessions: set[Session] = set()
        self.flusher = TickFlusher()  # flushes the sessions' frames once per loop tick
        # set by process_request, taken by the handler; weak so failed handshakes leave nothing behind
        self._principals: weakref.WeakKeyDictionary[ServerConnection, Principal] = weakref.WeakKeyDictionary()
        # open sessions per API key hash (max_connections_per_key); an entry goes when its count is 0
        self._per_key: dict[str, int] = {}
        self._tasks: list[asyncio.Task] = []
        self._server: Any = None
        self._state = "new"  # new -> starting -> started -> stopped
        self._lock = asyncio.Lock()
        self._page: bytes | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        async with self._lock:
            if self._state == "started":
                return
            if self._state == "stopped":
                raise RuntimeError("a stopped Edge cannot be restarted; create a new one")
            cfg = self.config
            if self.admission.encoder is None:
                if cfg.model_path is None:
                    raise ValueError("EdgeConfig.model_path is required when no encoder is given")
                self.admission.encoder = await asyncio.to_thread(PromptEncoder.from_path, cfg.model_path)
            specs = {spec.name: spec for m in self.admission.models.bases for spec in cfg.layout.model_specs(m)}
            await self.bus.ensure_topics([*specs.values(), cfg.layout.reply_spec(cfg.edge_id)]
                                         + ([cfg.layout.edges_spec()] if self.fleet is not None else []))
            self.admission.open_outbox()
            # the fleet's shared state (stored responses, resumable streams): a bus table, read
            # back by every edge (docs/protocol.md, "Resuming a stream")
            self.table = CompactedTable(self.bus, cfg.layout.table_spec("edge", int(cfg.responses_retention_s * 1000)),
                                        max_entries=cfg.responses_max_stored, max_value_bytes=cfg.responses_max_bytes,
                                        max_bytes=cfg.responses_view_bytes)
            await self.table.start()
            self.admission.directory = StreamDirectory(self.table)
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self.router.run(), name="edge-router"),
                loop.create_task(self._read_status(), name="edge-status"),
                loop.create_task(self.admission.run_cancels(), name="edge-cancels"),
                loop.create_task(self._sweep(), name="edge-sweep"),
            ]
            try:
                await asyncio.wait_for(self.router.wait_ready(), 30)
                if self.fleet is not None:
                    await self.fleet.start()
                    if not await self.fleet.wait_fresh(FLEET_START_WAIT_S):
                        log.warning("fleet limits: this edge's heartbeat did not come back within %g s; keys with "
                                    "limits are refused (503) until it does", FLEET_START_WAIT_S)
                self._server = await serve(
                    self._handle, cfg.host, cfg.port,
                    process_request=self._process_request,
                    select_subprotocol=lambda _conn, offered: select_subprotocol(offered),
                    max_size=cfg.max_frame_bytes, max_queue=16, compression=None,
                    ping_interval=cfg.ping_interval_s, ping_timeout=cfg.ping_timeout_s,
                    close_timeout=cfg.close_timeout_s, backlog=4096, reuse_port=cfg.reuse_port or None)
                if cfg.openai_port is not None:
                    assert self.table is not None
                    self.openai = OpenAIServer(self.admission, cfg.host, cfg.openai_port, ResponseStore(self.table),
                                               self.readiness)
                    MessagesRoutes(self.admission).add_to(self.openai.app)
                    await self.openai.start()
            except BaseException:
                if self._server is not None:
                    self._server.close()
                if self.fleet is not None:
                    await self.fleet.stop()
                await self._stop_tasks()
                self._state = "stopped"
                raise
            self._state = "started"
            log.info("edge %s listening on %s:%d (model %s, reply topic %s)%s", cfg.edge_id, cfg.host, self.port,
                     cfg.model, self.reply_topic, " [DEV MODE: no API keys]" if cfg.dev_mode else "")

    async def stop(self) -> None:
        async with self._lock:
            if self._state != "started":
                self._state = "stopped"
                return
            self._state = "stopped"
            self._server.close(close_connections=True)
            if self.openai is not None:
                await self.openai.stop()  # cancels its handlers: their requests are cancelled
            await self._server.wait_closed()
            # Handlers have ended and queued their Cancels: give the outbox a moment to drain.
            for _ in range(100):
                if self.admission.outbox_empty():
                    break
                await asyncio.sleep(0.01)
            if self.fleet is not None:
                await self.fleet.stop()  # after the handlers: their streams are no longer held
            await self._stop_tasks()

    async def _stop_tasks(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.table is not None:
            await self.table.stop()
            self.table = None

    async def __aenter__(self) -> Edge:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``)."""
        return self._server.sockets[0].getsockname()[1] if self._server else self.config.port

    @property
    def openai_port(self) -> int | None:
        """The OpenAI API's bound port (useful with ``openai_port=0``); ``None`` when it is off."""
        return self.openai.port if self.openai is not None else self.config.openai_port

    @property
    def encoder(self) -> PromptEncoder | None:
        return self.admission.encoder

    # --- bus ----------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return self.admission.new_request_id()

    def publish_cancel(self, request_id: str, reason: str) -> None:
        self.admission.publish_cancel(request_id, reason)

    async def _read_status(self) -> None:
        stale = self.config.heartbeat_stale_s
        consumer = self.bus.consumer([self.config.layout.status_topic], group_id=None,
                                     start_from=int((time.time() - stale) * 1000))
        await consumer.start()
        try:
            while True:
                records = await consumer.getmany(timeout_ms=500, max_records=1024)
                checkpoint()
                for rec in records:
                    try:
                        msg = decode(rec.value)
                    except DecodeError:
                        self.metrics.bad_records.inc()
                        continue
                    if isinstance(msg, WorkerStatus):
                        age = max(0.0, time.time() - rec.timestamp_ms / 1000)
                        self.admission.models.observe(msg, time.monotonic() - age)  # each model's shedder
        finally:
            await consumer.stop()

    async def _sweep(self) -> None:
        """Every SWEEP_INTERVAL_S: slow writers, request deadlines, live-worker gauge."""
        loop = asyncio.get_running_loop()
        grace = self.config.slow_client_grace_s
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now = loop.time()
            for s in list(self.sessions):
                if s.send_since is not None and now - s.send_since > grace:
                    s.kill(1008, "client too slow: socket write blocked")
            self.admission.lifecycle.expire(now)
            mono = time.monotonic()
            self.admission.models.prune(mono)
            self.metrics.live_workers.set(len(self.shedder.live(mono)))
            if self.limiter.fleet is not None:
                self.metrics.live_edges.set(self.limiter.fleet.live_edges())

    # --- HTTP + handshake ---------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        if not self.router.connected:
            return False, "not ready: reply consumer not connected to the bus"
        ok, why = self.shedder.readiness(time.monotonic())
        return ok, ("ready: " if ok else "not ready: ") + why

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        route = urlsplit(request.path).path
        if route == "/healthz":
            return _text(HTTPStatus.OK, "ok\n")
        if route == "/readyz":
            ok, why = self.readiness()
            return _text(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, why + "\n")
        if route == "/metrics":
            return _response(HTTPStatus.OK, self.metrics.render(), CONTENT_TYPE)
        upgrade = (request.headers.get("Upgrade") or "").lower() == "websocket"
        if not upgrade:
            if route in ("/", "/index.html"):
                return _response(HTTPStatus.OK, self._index(), "text/html; charset=utf-8")
            return _text(HTTPStatus.NOT_FOUND, f"no such path {route!r}\n")
        if route not in WS_PATHS:
            return _text(HTTPStatus.NOT_FOUND, "WebSocket endpoint is /ws\n")
        try:
            principal = self.auth.authenticate(extract_key(request.path, request.headers))
        except AuthError as exc:
            self.metrics.rejections.labels("unauthorized", "ws").inc()
            resp = _text(HTTPStatus.UNAUTHORIZED, f"{exc}\n")
            resp.headers["WWW-Authenticate"] = 'Bearer realm="lockgate"'
            return resp
        if len(self.sessions) + len(self._principals) >= self.config.max_connections:
            self.metrics.rejections.labels("overloaded", "ws").inc()
            return _text(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections\n", retry_after=1.0)
        per_key = self.config.max_connections_per_key
        if per_key and not self.config.dev_mode:
            h = principal.entry.key_hash
            held = self._per_key.get(h, 0) + sum(1 for p in self._principals.values() if p.entry.key_hash == h)
            if held >= per_key:
                self.metrics.rejections.labels("rate_limited", "ws").inc()
                return _text(HTTPStatus.TOO_MANY_REQUESTS, f"this API key holds {held} open connections, "
                             f"max_connections_per_key is {per_key}\n", retry_after=1.0)
        shed = self.shedder.check(principal.tier, time.monotonic())
        if shed is not None:
            self.metrics.rejections.labels("overloaded", "ws").inc()
            return _text(HTTPStatus.SERVICE_UNAVAILABLE, f"overloaded: {shed.reason}\n", retry_after=shed.retry_after)
        self._principals[conn] = principal
        return None

    def _index(self) -> bytes:
        if self._page is None or os.environ.get("LOCKGATE_DEV_STATIC"):
            page = (STATIC_DIR / "index.html").read_bytes()
            if self.config.dev_mode:  # no key is needed: the page connects by itself
                page = page.replace(b'data-dev-mode="0"', b'data-dev-mode="1"', 1)
            self._page = page
        return self._page

    async def _handle(self, ws: ServerConnection) -> None:
        principal = self._principals.pop(ws, None)
        if principal is None:  # cannot happen: process_request admitted it
            await ws.close(1011, "internal error: no principal")
            return
        # The handshake's response (a header map, ~12 GC-tracked objects) is not used once the
        # connection is open; at 10,000 connections every object a full collection must traverse
        # is pause time (see lockgate.runtime.freeze_heap). ``ws.request`` must stay: websockets
        # reads ``request is None`` as "handshake not done yet".
        ws.response = None
        session = Session(self.admission, self.flusher, ws, principal)
        h = principal.entry.key_hash
        self.sessions.add(session)
        self._per_key[h] = self._per_key.get(h, 0) + 1
        self.metrics.connections.inc()
        try:
            await session.run()
        finally:
            self.sessions.discard(session)
            if self._per_key[h] <= 1:
                del self._per_key[h]
            else:
                self._per_key[h] -= 1
            self.metrics.connections.dec()


def _response(status: HTTPStatus, body: bytes, content_type: str) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store"), ("Connection", "close")])
    return Response(status.value, status.phrase, headers, body)


def _text(status: HTTPStatus, text: str, retry_after: float | None = None) -> Response:
    resp = _response(status, text.encode(), "text/plain; charset=utf-8")
    if retry_after is not None:
        resp.headers["Retry-After"] = str(max(1, int(-(-retry_after // 1))))
    return resp
