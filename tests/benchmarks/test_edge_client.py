"""The benchmark's lean WebSocket client (benchmarks/edge/client.py) against the websockets server."""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.server import serve

from benchmarks.edge.client import WsClientError, connect_raw, mask_frame
from tests.waiting import wait_until


async def test_echo_all_length_encodings_ping_and_close() -> None:
    async def echo(ws) -> None:
        async for msg in ws:
            if msg == "ping me":
                await asyncio.wait_for(await ws.ping(), 5)  # resolves only when our pong arrives
                await ws.send("pong seen")
            elif msg == "bye":
                await ws.close(1000)
            else:
                await ws.send(msg)

    got: list[bytes] = []
    async with serve(echo, "127.0.0.1", 0, compression=None, max_size=None) as server:
        port = server.sockets[0].getsockname()[1]
        c = await connect_raw("127.0.0.1", port, "/", got.append, timeout=10)
        sizes = [0, 5, 125, 126, 65535, 65536, 70_000]  # 7-bit, 16-bit and 64-bit lengths both ways
        for n in sizes:
            c.send_text(("é" * n).encode()[:n] if n % 2 == 0 else b"x" * n)
        c.send_text(b"ping me")
        await wait_until(lambda: len(got) == len(sizes) + 1)
        assert [len(g) for g in got[:-1]] == sizes and got[-1] == b"pong seen"
        assert c.open
        c.send_text(b"bye")
        await asyncio.wait_for(c.closed, 5)
        assert not c.open and c.error is None


async def test_refused_handshake_is_an_error() -> None:
    async def not_ws(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(not_ws, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(WsClientError, match="404"):
            await connect_raw("127.0.0.1", port, "/", lambda _: None, timeout=10)


def test_client_frames_are_masked_and_unmask_back() -> None:
    payload = b"hello, edge" * 20
    frame = mask_frame(0x1, payload)
    assert frame[0] == 0x81 and frame[1] == 0x80 | 126 and int.from_bytes(frame[2:4], "big") == len(payload)
    key, body = frame[4:8], frame[8:]
    assert bytes(b ^ key[i % 4] for i, b in enumerate(body)) == payload
