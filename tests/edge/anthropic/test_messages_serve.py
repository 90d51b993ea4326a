"""The Messages API from ``lockgate serve`` as users run it (the embedded platform: edge, real
worker on the tiny model, in-memory bus), through the official ``anthropic`` SDK on the OpenAI
API's port."""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import Any

import anthropic

from lockgate.serve import register, run_embedded

MESSAGES: list[Any] = [{"role": "user", "content": "Kafka topics are partitioned"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_anthropic_sdk_against_lockgate_serve(tiny_model_dir: str) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    port = free_port()
    args = parser.parse_args(["serve", "--model", tiny_model_dir, "--port", "0", "--openai-port", str(port),
                              "--kv-cache-bytes", "8M", "--bus", "memory://messages-serve-test"])
    ready, stop = asyncio.get_running_loop().create_future(), asyncio.Event()
    task = asyncio.create_task(run_embedded(args, ready, stop, freeze=False))
    try:
        await asyncio.wait_for(ready, 60)
        async with anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="dev", max_retries=0,
                                            timeout=60) as client:
            model = (await client.models.list()).data[0].id
            kw: dict[str, Any] = {"model": model, "max_tokens": 16, "messages": MESSAGES,
                                  "extra_body": {"temperature": 0}}
            m = await client.messages.create(**kw)
            assert m.content[0].type == "text" and m.stop_reason in ("max_tokens", "end_turn")
            async with client.messages.stream(**kw) as s:
                streamed = "".join([t async for t in s.text_stream])
            assert streamed == m.content[0].text
            n = (await client.messages.count_tokens(model=model, messages=MESSAGES)).input_tokens
            assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
