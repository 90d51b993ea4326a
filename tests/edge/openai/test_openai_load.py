"""Bounded load on the OpenAI API: 500 concurrent SSE streams held open and completed (fake worker),
and the edge's CPU per streamed token.

The edge (and its fake worker: one event loop) runs in its own thread, so its CPU is that thread's
CPU clock, apart from the 500 clients' parsing on this thread. The figure is printed (``-s``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from devtools.fake_worker import expected_text
from tests.edge.conftest import MODEL, running_edge

STREAMS = 500
TOKENS = 100


@pytest.fixture
def edge_thread(encoder) -> Iterator[dict]:
    ready = threading.Event()
    box: dict = {}

    async def main() -> None:
        box["loop"] = asyncio.get_running_loop()
        box["stop"] = asyncio.Event()
        box["clock"] = time.pthread_getcpuclockid(threading.get_ident())
        async with running_edge(encoder, keys=None, openai_port=0, worker_kw={"step_s": 0.02}) as (edge, fw):
            box["edge"], box["fw"] = edge, fw
            ready.set()
            await box["stop"].wait()

    t = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    t.start()
    assert ready.wait(60), "edge did not start"
    yield box
    box["loop"].call_soon_threadsafe(box["stop"].set)
    t.join(30)


async def test_500_concurrent_sse_streams(edge_thread: dict) -> None:
    edge, fw = edge_thread["edge"], edge_thread["fw"]
    url = f"http://127.0.0.1:{edge.openai_port}/v1/chat/completions"
    started = asyncio.Event()
    open_streams = 0

    async def stream(h: aiohttp.ClientSession, i: int) -> tuple[str, str, int]:
        nonlocal open_streams
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": TOKENS,
                "stream": True, "stream_options": {"include_usage": True}}
        text, usage, rid = [], 0, ""
        async with h.post(url, json=body) as r:
            assert r.status == 200
            open_streams += 1
            if open_streams == STREAMS:
                started.set()
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    data = ev.removeprefix(b"data: ")
                    if data == b"[DONE]":
                        return rid, "".join(text), usage
                    obj = orjson.loads(data)
                    rid = obj["id"].removeprefix("chatcmpl-")
                    if obj["choices"]:
                        text.append(obj["choices"][0]["delta"].get("content") or "")
                    else:
                        usage = obj["usage"]["completion_tokens"]
        raise AssertionError("stream ended without [DONE]")

    clock = edge_thread["clock"]
    cpu0, t0 = time.clock_gettime(clock), time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as h:
        tasks = [asyncio.create_task(stream(h, i)) for i in range(STREAMS)]
        await asyncio.wait_for(started.wait(), 60)  # all 500 held open at once
        assert fw.tokens_sent < STREAMS * TOKENS
        results = await asyncio.gather(*tasks)
    cpu, wall = time.clock_gettime(clock) - cpu0, time.perf_counter() - t0
    by_rid = {r.request_id: r for r in fw.seen}
    for rid, text, usage in results:
        assert usage == TOKENS and text == expected_text(by_rid[rid].prompt_token_ids, TOKENS)
    tokens = STREAMS * TOKENS
    print(f"\nopenai SSE load: {STREAMS} streams x {TOKENS} tokens in {wall:.2f}s; edge thread (edge + fake "
          f"worker) CPU {cpu:.2f}s = {cpu / tokens * 1e6:.1f} us/token")


async def test_same_load_over_websocket_for_comparison(edge_thread: dict) -> None:
    """The same 500 x 100 tokens over the WebSocket API (one connection per stream), so the OpenAI
    figure above has its WebSocket twin from the same harness."""
    from websockets.asyncio.client import connect

    edge, fw = edge_thread["edge"], edge_thread["fw"]

    async def stream(i: int) -> tuple[str, str]:
        async with connect(f"ws://127.0.0.1:{edge.port}/ws", ping_interval=None, open_timeout=60) as ws:
            await ws.send(orjson.dumps({"type": "generate", "id": "s", "max_tokens": TOKENS,
                                        "messages": [{"role": "user", "content": f"question {i}"}]}).decode())
            text, rid = [], ""
            while True:
                f = orjson.loads(await asyncio.wait_for(ws.recv(), 60))
                if f["type"] == "accepted":
                    rid = f["request_id"]
                elif f["type"] == "delta":
                    text.append(f["text"])
                else:
                    assert f["type"] == "done", f
                    return rid, "".join(text)

    clock = edge_thread["clock"]
    cpu0, t0 = time.clock_gettime(clock), time.perf_counter()
    results = await asyncio.gather(*(stream(i) for i in range(STREAMS)))
    cpu, wall = time.clock_gettime(clock) - cpu0, time.perf_counter() - t0
    by_rid = {r.request_id: r for r in fw.seen}
    for rid, text in results:
        assert text == expected_text(by_rid[rid].prompt_token_ids, TOKENS)
    tokens = STREAMS * TOKENS
    print(f"\nwebsocket load: {STREAMS} streams x {TOKENS} tokens in {wall:.2f}s; edge thread (edge + fake "
          f"worker) CPU {cpu:.2f}s = {cpu / tokens * 1e6:.1f} us/token")
