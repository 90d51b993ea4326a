"""A lean WebSocket client for ``lockgate bench edge``: the load generator, not a product client.

Why not the ``websockets`` client: on the benchmark's 2 cores the client processes share the CPU
with the edge they measure, and ``websockets``' asyncio client spends ~15 us per received frame
(frame object, assembler, one ``recv()`` coroutine switch per message) — about as much as the edge
spends per token. That CPU is taken from the edge and shows up as edge latency. This client is an
``asyncio.Protocol`` that parses frames straight out of ``data_received`` (a few us per frame), so
the figures are the edge's, not the load generator's. ``--client websockets`` keeps the library
client for comparison (docs/benchmarks.md has both).

Scope, RFC 6455 as far as a benchmark client needs: the opening handshake (``Sec-WebSocket-Accept``
checked), masked client text frames, unmasked unfragmented server frames (text, close, ping ->
pong). Anything else (a masked or fragmented server frame, a bad handshake) is an error: the
benchmark must not silently measure something else. Compression is never offered.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
from collections.abc import Callable
from typing import cast

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class WsClientError(RuntimeError):
    pass


def mask_frame(opcode: int, payload: bytes) -> bytes:
    """One masked, final client frame (clients must mask, RFC 6455 5.3)."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 65536:
        head = bytes((0x80 | opcode, 0xFE)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0xFF)) + n.to_bytes(8, "big")
    key = os.urandom(4)
    stream = (key * (n // 4 + 1))[:n]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(stream, "big")).to_bytes(n, "big") if n else b""
    return head + key + masked


class RawWsClient(asyncio.Protocol):
    """One connection. ``on_text(payload)`` is called for every text frame, in order, from
    ``data_received`` (so it must not block). ``closed`` resolves when the connection is lost;
    ``error`` then says why if the server broke the protocol."""

    def __init__(self, host: str, path: str, on_text: Callable[[bytes], None]) -> None:
        loop = asyncio.get_running_loop()
        self.on_text = on_text
        self.opened: asyncio.Future = loop.create_future()
        self.closed: asyncio.Future = loop.create_future()
        self._key = base64.b64encode(os.urandom(16))
        self._request = (b"GET %s HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\n\r\n"
                         % (path.encode(), host.encode(), self._key))
        self._buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.error: str | None = None

    @property
    def open(self) -> bool:
        return self.opened.done() and not self.opened.exception() and not self.closed.done()

    # --- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_connection: a stream transport
        self.transport.write(self._request)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.opened.done():
            self.opened.set_exception(WsClientError(f"connection lost during the handshake: {exc}"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if not self.opened.done():
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self._handshake(bytes(buf[:end]))
            del buf[: end + 4]
            if self.opened.exception() is not None:
                return
        pos, n = 0, len(buf)
        while n - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            if b1 & 0x80 or not b0 & 0x80:
                self._fail("server sent a masked or fragmented frame")
                return
            size, hdr = b1 & 0x7F, 2
            if size == 126:
                if n - pos < 4:
                    break
                size, hdr = int.from_bytes(buf[pos + 2 : pos + 4], "big"), 4
            elif size == 127:
                if n - pos < 10:
                    break
                size, hdr = int.from_bytes(buf[pos + 2 : pos + 10], "big"), 10
            if n - pos < hdr + size:
                break
            payload = bytes(buf[pos + hdr : pos + hdr + size])
            pos += hdr + size
            opcode = b0 & 0x0F
            if opcode == 0x1:
                self.on_text(payload)
            elif opcode == 0x9:
                assert self.transport is not None  # data comes only after connection_made
                self.transport.write(mask_frame(0xA, payload))
            elif opcode == 0x8:
                self.close()
                break
        del buf[:pos]

    # --- client API ----------------------------------------------------------------------------
    def send_text(self, payload: bytes) -> None:
        assert self.transport is not None  # connect_raw returns only after connection_made
        self.transport.write(mask_frame(0x1, payload))

    def close(self) -> None:
        """Send a normal close frame (1000) and close the socket (no wait for the echo)."""
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(mask_frame(0x8, (1000).to_bytes(2, "big")))
            t.close()

    def _handshake(self, head: bytes) -> None:
        assert self.transport is not None  # data comes only after connection_made
        lines = head.split(b"\r\n")
        if not lines[0].startswith(b"HTTP/1.1 101"):
            self.opened.set_exception(WsClientError(f"handshake refused: {lines[0][:80]!r}"))
            self.transport.close()
            return
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
        want = base64.b64encode(hashlib.sha1(self._key + _GUID).digest())
        if headers.get(b"sec-websocket-accept") != want or headers.get(b"sec-websocket-extensions"):
            self.opened.set_exception(WsClientError("bad Sec-WebSocket-Accept or an unrequested extension"))
            self.transport.close()
            return
        self.opened.set_result(None)

    def _fail(self, why: str) -> None:
        self.error = why
        assert self.transport is not None  # data comes only after connection_made
        self.transport.abort()


async def connect_raw(host: str, port: int, path: str, on_text: Callable[[bytes], None],
                      timeout: float = 60.0) -> RawWsClient:
    """Open a connection and finish the handshake; raises ``WsClientError`` or ``OSError``."""
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(lambda: RawWsClient(f"{host}:{port}", path, on_text), host, port)
    done, _ = await asyncio.wait({proto.opened}, timeout=timeout)
    if not done:
        assert proto.transport is not None  # create_connection returned: connection_made ran
        proto.transport.abort()
        raise WsClientError(f"handshake with {host}:{port} timed out after {timeout} s")
    proto.opened.result()
    return proto
