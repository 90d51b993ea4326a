"""Bounded load: 2,000 connections held, 200 of them streaming at once, all complete."""

from __future__ import annotations

import asyncio
import time

import orjson
from websockets.asyncio.client import connect

from devtools.fake_worker import expected_text
from tests.edge.conftest import running_edge, url
from tests.waiting import wait_until

CONNECTIONS = 2000
STREAMING = 200
TOKENS = 50


async def test_2000_connections_200_streams(encoder):
    t0 = time.monotonic()
    async with running_edge(encoder, keys=None, worker_kw={"step_s": 0.005}) as (edge, fw):
        sem = asyncio.Semaphore(64)

        async def open_one():
            async with sem:
                return await connect(url(edge), ping_interval=None, open_timeout=30)

        conns = await asyncio.gather(*(open_one() for _ in range(CONNECTIONS)))
        assert len(edge.sessions) == CONNECTIONS
        assert "lockgate:edge_connections 2000.0" in edge.metrics.render().decode()

        async def stream(i, ws):
            await ws.send(orjson.dumps({"type": "generate", "id": f"s{i}", "max_tokens": TOKENS,
                                        "messages": [{"role": "user", "content": f"question {i}"}]}).decode())
            text = []
            while True:
                f = orjson.loads(await asyncio.wait_for(ws.recv(), 30))
                if f["type"] == "accepted":
                    rid = f["request_id"]
                elif f["type"] == "delta":
                    text.append(f["text"])
                else:
                    assert f["type"] == "done", f
                    return rid, "".join(text)

        results = await asyncio.gather(*(stream(i, conns[i * (CONNECTIONS // STREAMING)]) for i in range(STREAMING)))
        by_rid = {r.request_id: r for r in fw.seen}
        for rid, text in results:
            assert text == expected_text(by_rid[rid].prompt_token_ids, TOKENS)
        assert len(edge.sessions) == CONNECTIONS  # everyone still connected
        await asyncio.gather(*(c.close() for c in conns))
        await wait_until(lambda: not edge.sessions, timeout=60, interval=0.05)
    assert time.monotonic() - t0 < 60
