"""WebSocket resume across edges (memory bus, fake worker): a resumable request's client goes away
mid-stream and picks it up again with a ``resume`` frame on another edge, with nothing lost and
nothing repeated; another key finds nothing; a non-resumable request is cancelled as before."""

from __future__ import annotations

import contextlib

from websockets.asyncio.client import connect

from bus import MemoryBus
from devtools.fake_worker import FakeWorker, expected_text
from edge.config import EdgeConfig
from edge.server import Edge
from tests.edge.conftest import KEY, KEY_P0, MODEL, keys, recv, send, wait_for


def ws(edge: Edge, key: str = KEY):
    return connect(f"ws://127.0.0.1:{edge.port}/ws", additional_headers={"Authorization": f"Bearer {key}"})


async def test_a_resumable_stream_continues_on_another_edge(encoder):
    async with MemoryBus("memory://") as bus, FakeWorker(bus, MODEL, step_s=0.02) as fw, \
            contextlib.AsyncExitStack() as stack:
        edges = []
        for name in ("a", "b"):
            e = await stack.enter_async_context(Edge(EdgeConfig(model=MODEL, port=0, keys=keys(), ping_interval_s=None,
                                                                edge_id=f"ws-{name}"), bus, encoder))
            await wait_for(lambda e=e: e.readiness()[0])
            edges.append(e)
        want = expected_text(tuple(encoder.text_ids("hello there")), 40)
        text, nxt = "", 0
        async with ws(edges[0]) as c:
            await send(c, {"type": "generate", "id": "g", "prompt": "hello there", "max_tokens": 40,
                           "resumable": True})
            rid = (await recv(c))["request_id"]
            while nxt < 5:
                f = await recv(c)
                assert f["type"] == "delta" and f["seq"] == nxt
                text, nxt = text + f["text"], f["seq"] + len(f["token_ids"])
        # the connection is gone (no cancel for a resumable request); another edge resumes it
        async with ws(edges[1], KEY_P0) as other:
            await send(other, {"type": "resume", "id": "r", "request_id": rid, "seq": nxt})
            f = await recv(other)
            assert f["type"] == "error" and f["code"] == "not_found" and f["field"] == "request_id"
        async with ws(edges[1]) as c:
            await send(c, {"type": "resume", "id": "r", "request_id": rid, "seq": nxt})
            while True:
                f = await recv(c)
                if f["type"] == "done":
                    break
                assert f["type"] == "delta" and f["id"] == "r" and f["seq"] == nxt, f
                text, nxt = text + f["text"], f["seq"] + len(f["token_ids"])
        assert text == want and nxt == 40 and f["usage"]["completion_tokens"] == 40
        assert not [x for x in fw.cancels if x.request_id == rid]
