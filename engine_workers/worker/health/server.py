"""A tiny HTTP/1.1 server for probes and scraping: ``/healthz``, ``/readyz``, ``/metrics``.

Stdlib asyncio streams; GET/HEAD only, one request per connection (``Connection: close``), request
head bounded in size and time, so a slow or hostile client costs one short-lived task.

* ``/healthz`` 200 while the worker's loops are alive (``live()``), else 503 — for restarts.
* ``/readyz``  200 while it takes work (``ready()``: started, consumer assigned, not draining),
  else 503 — for load balancers and rollouts.
* ``/metrics`` the Prometheus text exposition of ``metrics()``.

Lifecycle: ``start``/``stop`` are idempotent; ``stop`` closes the listener and waits for the
connections in progress (each is bounded by ``HEAD_TIMEOUT_S``). ``port`` is the bound port (useful
with ``port=0``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 8192


class HealthServer:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        live: Callable[[], bool],
        ready: Callable[[], bool],
        metrics: Callable[[], bytes],
        metrics_content_type: str = "text/plain; version=0.0.4; charset=utf-8",
    ) -> None:
        self.host = host
        self._port = port
        self._live = live
        self._ready = ready
        self._metrics = metrics
        self._metrics_type = metrics_content_type
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        if self._server is not None and self._server.sockets:
            return self._server.sockets[0].getsockname()[1]
        return self._port

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, self.host, self._port, limit=MAX_HEAD_BYTES)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    async def __aenter__(self) -> HealthServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            method, path = _parse(head)
            status, ctype, body = self._route(method, path)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            if method != "HEAD":
                writer.write(body)
            await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        except Exception:  # a probe must never take the worker down
            log.exception("health endpoint failed")
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        text = "text/plain; charset=utf-8"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", text, b"method not allowed\n"
        if path == "/healthz":
            ok = self._live()
            return ("200 OK" if ok else "503 Service Unavailable"), text, b"ok\n" if ok else b"unhealthy\n"
        if path == "/readyz":
            ok = self._ready()
            return ("200 OK" if ok else "503 Service Unavailable"), text, b"ready\n" if ok else b"not ready\n"
        if path == "/metrics":
            return "200 OK", self._metrics_type, self._metrics()
        return "404 Not Found", text, b"not found\n"


def _parse(head: bytes) -> tuple[str, str]:
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError(f"bad request line {line!r}")
    return parts[0].upper(), parts[1].split("?", 1)[0]
