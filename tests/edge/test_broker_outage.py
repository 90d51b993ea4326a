"""The edge with its Kafka broker down (issue #38): new requests get a fast, clear 503 (not a
hang), a request is never acknowledged unless it was written to the bus, and the edge serves
again when the broker returns. A private broker on its own port (started and stopped here, never
the shared ones), the fake worker on it, the OpenAI HTTP API and the WebSocket protocol."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from websockets.asyncio.client import connect as ws_connect

from bus import TopicLayout, connect
from devtools import kafka_local
from devtools.fake_worker import FakeWorker
from edge.config import EdgeConfig
from edge.server import Edge
from tests.edge.conftest import MODEL, collect, send
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]
OUTAGE_PORT = 19892  # its controller on +100; apart from the session (9092) and private (19392) brokers
PUBLISH_TIMEOUT_S = 2.0
FAST_S = PUBLISH_TIMEOUT_S + 3.0  # a refusal comes at the edge's publish bound, long before the bus's own 30 s


class OwnBroker:
    def __init__(self) -> None:
        self.bootstrap = ""

    async def start(self, fresh: bool = False) -> None:
        info = await asyncio.to_thread(kafka_local.start, 1, OUTAGE_PORT, kafka_local.DEFAULT_DIR, fresh=fresh)
        self.bootstrap = info.bootstrap

    async def stop(self) -> None:
        await asyncio.to_thread(kafka_local.stop, 1, OUTAGE_PORT, kafka_local.DEFAULT_DIR)


@pytest.fixture
async def broker(kafka_bootstrap) -> AsyncIterator[OwnBroker]:  # after the session broker (its jars fetched)
    b = OwnBroker()
    await b.start(fresh=True)
    try:
        yield b
    finally:
        await b.stop()
        shutil.rmtree(kafka_local._cluster_dir(kafka_local.DEFAULT_DIR, 1, OUTAGE_PORT), ignore_errors=True)


def url(bootstrap: str) -> str:
    return f"kafka://{bootstrap}?linger_ms=1&fetch_max_wait_ms=50&request_timeout_ms=30000"


@contextlib.asynccontextmanager
async def edge_on(bootstrap: str, encoder):
    layout = TopicLayout(namespace=f"o{time.monotonic_ns() % 10**9}", partitions=2)
    async with connect(url(bootstrap)) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL))
        fw = FakeWorker(bus, MODEL, layout=layout)
        await fw.start()
        try:
            cfg = EdgeConfig(model=MODEL, port=0, openai_port=0, layout=layout, ping_interval_s=None,
                             publish_timeout_s=PUBLISH_TIMEOUT_S)
            async with Edge(cfg, bus, encoder) as edge:
                await wait_until(lambda: edge.readiness()[0], timeout=60, interval=0.05,
                                 message="edge ready on the private broker")
                yield edge, fw
        finally:
            await fw.stop()


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def chat(http: aiohttp.ClientSession, base: str, stream: bool = False) -> tuple[int, bytes, float]:
    t0 = time.monotonic()
    async with http.post(base + "/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
        return r.status, await r.read(), time.monotonic() - t0


async def test_edge_with_the_broker_down_answers_503_fast_and_recovers(broker, encoder) -> None:
    async with edge_on(broker.bootstrap, encoder) as (edge, fw), \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        base = f"http://127.0.0.1:{edge.openai_port}"
        status, raw, _ = await chat(http, base)
        assert status == 200, raw
        async with ws_connect(f"ws://127.0.0.1:{edge.port}/ws") as ws:  # open before the outage
            await broker.stop()
            try:
                # from the first request of the outage on: refused fast with a 503 that says why (the
                # bus, or, once the workers' heartbeats over it are stale, no live worker), streaming
                # or not; never a 200 (a stream acknowledged that was never queued)
                answers = []
                for stream in (False, True, False, True):
                    status, raw, took = await chat(http, base, stream)
                    answers.append((status, raw[:300], round(took, 2)))
                print("outage answers:", answers)
                for status, raw, took in answers:
                    assert status == 503 and took < FAST_S, answers
                    err = orjson.loads(raw)["error"]
                    assert err["code"] == "overloaded" and ("bus is unreachable" in err["message"]
                                                            or "no live worker" in err["message"]), err
                assert "bus is unreachable" in orjson.loads(answers[0][1])["error"]["message"], answers[0]
                # the WebSocket protocol: an error frame, fast, and no token
                t0 = time.monotonic()
                await send(ws, {"type": "generate", "id": "w", "prompt": "hi", "max_tokens": 3})
                _, deltas, final = await collect(ws, "w", timeout=FAST_S)
                assert final["type"] == "error" and final["code"] == "overloaded" and not deltas, final
                assert time.monotonic() - t0 < FAST_S
            finally:  # the broker back before anything shuts down (a client flushing into a dead broker waits)
                await broker.start()

        async def serves() -> bool:
            status, _, _ = await chat(http, base)
            return status == 200

        await wait_until(serves, timeout=120, interval=0.5, message="the edge serves again after the broker returns")
