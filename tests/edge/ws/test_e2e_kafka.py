"""End to end over real Kafka: WebSocket client -> edge -> Kafka -> real worker (subprocess) -> edge
-> client. The streamed text equals the engine's own output for the same prompt tokens."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from websockets.asyncio.client import connect as ws_connect

from bus import connect
from edge.config import EdgeConfig
from edge.request import PromptEncoder
from edge.server import Edge
from edge.ws.protocol import parse_client_frame
from engine_workers.worker.actor import Worker, WorkerConfig
from lockgate_types import SamplingParams
from tests.edge.conftest import collect, recv, send, wait_for
from tests.engine_workers.worker.test_worker_kafka import (
    kafka_url,
    new_layout,
    spawn_worker,
    wait_ready,
)
from tests.engine_workers.worker.test_worker_memory import MODEL, make_engine, tiny_dir  # noqa: F401 - pytest fixtures, used by name

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

MESSAGES = [{"role": "user", "content": "Tell me about Kafka topics."}]


async def test_websocket_stream_equals_engine_output(kafka_bootstrap: str, tiny_dir: Path, tmp_path: Path) -> None:
    layout = new_layout(2)
    encoder = PromptEncoder.from_path(str(tiny_dir))
    frame = parse_client_frame(__import__("orjson").dumps(
        {"type": "generate", "id": "x", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "ignore_eos": True}))
    prompt_ids = encoder.encode(frame)
    ref = make_engine(tiny_dir).generate([prompt_ids], [SamplingParams(max_tokens=24, temperature=0.0,
                                                                       ignore_eos=True)])[0]
    async with connect(kafka_url(kafka_bootstrap)) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL))
        proc = spawn_worker(kafka_bootstrap, tiny_dir, layout, "w-e2e", tmp_path / "worker.log")
        try:
            await wait_ready(proc)
            cfg = EdgeConfig(model=MODEL, port=0, layout=layout, ping_interval_s=None)
            async with Edge(cfg, bus, encoder) as edge:
                await wait_for(lambda: edge.readiness()[0], timeout=30)
                async with ws_connect(f"ws://127.0.0.1:{edge.port}/ws") as ws:
                    await send(ws, {"type": "generate", "id": "x", "messages": MESSAGES, "max_tokens": 24,
                                    "temperature": 0, "ignore_eos": True, "token_ids": True})
                    text, deltas, done = await collect(ws, "x", timeout=60)
            assert done["type"] == "done", done
            assert [t for d in deltas for t in d["token_ids"]] == list(ref.token_ids)
            assert text == ref.text
            assert done["usage"]["completion_tokens"] == 24
        finally:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)
            if proc.stdout is not None:
                proc.stdout.close()


async def test_stream_through_a_broker_restart(private_kafka, tiny_dir: Path) -> None:
    """WebSocket client -> edge -> Kafka -> worker, the broker stopped cleanly mid-stream and
    started again: the client's stream is the engine's output, each token once. Until the first
    worker heartbeat after the restart the edge sheds new requests (`overloaded` with
    `retry_after`, the documented policy for no live worker); then it serves them again."""
    layout = new_layout(2)
    encoder = PromptEncoder.from_path(str(tiny_dir))
    gen = {"type": "generate", "messages": MESSAGES, "temperature": 0, "ignore_eos": True}
    prompt_ids = encoder.encode(parse_client_frame(__import__("orjson").dumps({**gen, "id": "x", "max_tokens": 300})))
    ref = make_engine(tiny_dir).generate([prompt_ids], [SamplingParams(max_tokens=300, temperature=0.0,
                                                                       ignore_eos=True)])[0]
    engine = make_engine(tiny_dir)
    async with connect(kafka_url(private_kafka.bootstrap)) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL))
        # before_step: the stream must outlast the outage
        async with Worker(WorkerConfig(MODEL, layout=layout), bus, engine, before_step=lambda: time.sleep(0.02)), \
                Edge(EdgeConfig(model=MODEL, port=0, layout=layout, ping_interval_s=None), bus, encoder) as edge:
            await wait_for(lambda: edge.readiness()[0], timeout=30)
            async with ws_connect(f"ws://127.0.0.1:{edge.port}/ws") as ws:
                await send(ws, {**gen, "id": "x", "max_tokens": 300, "token_ids": True})
                tokens: list[int] = []
                while len(tokens) < 30:
                    f = await recv(ws, 30)
                    assert f["type"] in ("accepted", "delta"), f
                    tokens += f.get("token_ids", [])
                await private_kafka.stop()
                await asyncio.sleep(3.0)  # not synchronisation: the outage itself, the thing under test
                await private_kafka.start()
                _, deltas, done = await collect(ws, "x", timeout=60)
                tokens += [t for d in deltas for t in d["token_ids"]]
                assert done["type"] == "done", done
                assert tokens == list(ref.token_ids), "every token once, in order, across the restart"
                for k in range(30):  # new requests: shed until a heartbeat arrives, then served
                    await send(ws, {**gen, "id": f"y{k}", "max_tokens": 4})
                    _, _, after = await collect(ws, f"y{k}", timeout=30)
                    if after["type"] == "done":
                        break
                    assert after["code"] == "overloaded" and after["retry_after"] > 0, after
                    await asyncio.sleep(0.5)  # a client backing off before it retries (the test's input)
                assert after["type"] == "done", "the edge serves again after the restart"
