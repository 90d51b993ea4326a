"""The embedded platform (`lockgate serve`): a WebSocket client's streamed text equals the engine's
own output for the same greedy request, and shutdown is clean."""

from __future__ import annotations

import argparse
import asyncio
import json

import websockets

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from lockgate.serve import register, run_embedded
from lockgate_types import SamplingParams


def serve_args(model: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub)
    return parser.parse_args(["serve", "--model", model, "--port", "0", "--kv-cache-bytes", "8M", "--bus", "memory://serve-test"])


async def test_embedded_platform_streams_engine_output(tiny_model_dir):
    args = serve_args(tiny_model_dir)
    ready, stop = asyncio.get_running_loop().create_future(), asyncio.Event()
    task = asyncio.create_task(run_embedded(args, ready, stop, freeze=False))
    port = await asyncio.wait_for(ready, 60)
    prompt = "Kafka topics are partitioned"
    async with websockets.connect(f"ws://127.0.0.1:{port}/ws") as ws:
        await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": prompt, "max_tokens": 24, "temperature": 0}))
        text, seqs = [], []
        for _ in range(100):
            msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if msg["type"] == "delta":
                text.append(msg["text"])
                seqs.append(msg["seq"])
            elif msg["type"] in ("done", "error"):
                break
    assert msg["type"] == "done", msg
    assert seqs[0] == 0 and seqs == sorted(set(seqs))  # in order; the edge may merge deltas
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20))
    (ref,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    assert "".join(text) == ref.text
    assert msg["usage"]["completion_tokens"] == len(ref.token_ids)
    stop.set()
    assert await asyncio.wait_for(task, 60) == 0


def test_serve_process_stops_on_sigint_without_teardown_noise(tiny_model_dir, run_until_signalled):
    """`lockgate serve` as users run it: SIGINT drains and exits 0, and stderr carries no teardown
    noise. The frozen start-up heap (freeze_heap) used to survive into interpreter finalization,
    where torch's triton bindings printed ~30 lines of "nanobind: leaked ..." on every stop."""
    import signal

    rc, err = run_until_signalled(["serve", "--model", tiny_model_dir, "--port", "0", "--kv-cache-bytes", "8M",
                                   "--bus", "memory://sigint-test"], "lockgate serving", signal.SIGINT)
    assert rc == 0 and "shutting down" in err
    assert "leaked" not in err and "Traceback" not in err, err[-2000:]
