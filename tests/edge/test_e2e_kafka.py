"""End to end over real Kafka: WebSocket client -> edge -> Kafka -> real worker (subprocess) -> edge
-> client. The streamed text equals the engine's own output for the same prompt tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from websockets.asyncio.client import connect as ws_connect

from bus import connect
from bus.messages import SamplingParams
from edge.config import EdgeConfig
from edge.protocol import PromptEncoder, parse_client_frame
from edge.server import Edge
from tests.edge.conftest import collect, send, wait_for
from tests.engine_workers.test_worker_kafka import kafka_url, new_layout, spawn_worker, wait_ready
from tests.engine_workers.test_worker_memory import MODEL, make_engine, tiny_dir  # noqa: F401

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
