"""The OpenAI API end to end over real Kafka: the ``openai`` SDK -> edge -> Kafka -> a real worker
(tiny model) -> edge -> SDK. Checks what the fake worker cannot: stop strings, seeds, logprobs,
exact usage, and that a client disconnect frees the worker's KV cache."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest

from bus import Cancel, ChatMessage, connect, decode
from edge.config import EdgeConfig
from edge.request import PromptEncoder
from edge.server import Edge
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.engine_workers.worker.test_worker_kafka import kafka_url, new_layout
from tests.engine_workers.worker.test_worker_memory import MODEL, make_engine, tiny_dir  # noqa: F401 - pytest fixtures, used by name
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

MESSAGES = [{"role": "user", "content": "Tell me about Kafka topics."}]


@contextlib.asynccontextmanager
async def platform(bootstrap: str, model_dir: Path, step_sleep_s: float = 0.0) -> AsyncIterator[tuple]:
    layout = new_layout(2)
    encoder = PromptEncoder.from_path(str(model_dir))
    engine = make_engine(model_dir)
    before = (lambda: time.sleep(step_sleep_s)) if step_sleep_s else None
    async with connect(kafka_url(bootstrap)) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL))
        async with Worker(WorkerConfig(MODEL, layout=layout), bus, engine, before_step=before), \
                Edge(EdgeConfig(model=MODEL, port=0, openai_port=0, layout=layout, ping_interval_s=None),
                     bus, encoder) as edge:
            await wait_until(lambda: edge.readiness()[0], timeout=30)
            yield edge, engine, bus, layout, encoder


async def test_openai_sdk_against_a_real_worker_over_kafka(kafka_bootstrap: str, tiny_dir: Path) -> None:
    async with contextlib.AsyncExitStack() as stack, \
            platform(kafka_bootstrap, tiny_dir) as (edge, engine, _, _, encoder):
        url = f"http://127.0.0.1:{edge.openai_port}/v1"
        client = openai.AsyncOpenAI(base_url=url, api_key="dev", max_retries=0, timeout=60)
        await stack.enter_async_context(client)
        n_prompt = len(encoder.chat_ids([ChatMessage(m["role"], m["content"]) for m in MESSAGES]))
        assert [m.id for m in (await client.models.list()).data] == [MODEL]

        greedy = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0,
                  "extra_body": {"ignore_eos": True}}
        r = await client.chat.completions.create(**greedy)
        text = r.choices[0].message.content
        assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 24
        assert r.usage.total_tokens == n_prompt + 24 and r.choices[0].finish_reason == "length"
        chunks = [c async for c in await client.chat.completions.create(
            **greedy, stream=True, stream_options={"include_usage": True})]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == n_prompt

        one = await client.chat.completions.create(**{**greedy, "max_tokens": 1})
        assert one.usage.completion_tokens == 1 and text.startswith(one.choices[0].message.content)

        # stop: the output ends just before the first occurrence of the stop string
        stop = text[len(text) // 2:len(text) // 2 + 3]
        if stop.strip():
            s = await client.chat.completions.create(**greedy, stop=stop)
            assert s.choices[0].finish_reason == "stop"
            assert s.choices[0].message.content == text[:text.index(stop)]

        # seeds at temperature > 0: the same seed gives the same text
        sampled = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0,
                   "extra_body": {"ignore_eos": True}}
        a = await client.chat.completions.create(**sampled, seed=1234)
        b = await client.chat.completions.create(**sampled, seed=1234)
        assert a.choices[0].message.content == b.choices[0].message.content

        # logprobs: one entry per token, top_logprobs alternatives each
        lp = await client.chat.completions.create(**{**greedy, "max_tokens": 6}, logprobs=True, top_logprobs=3)
        content = lp.choices[0].logprobs.content
        assert len(content) == 6 and all(len(e.top_logprobs) == 3 for e in content)
        assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.logprob - 1e-4 for e in content)
        assert "".join(e.token for e in content) == lp.choices[0].message.content  # greedy, no stop

        # completions, sync client (in a thread: this loop serves the edge), prompt as token ids
        ids = encoder.text_ids("Once upon a time")

        def sync_calls() -> tuple:
            with openai.OpenAI(base_url=url, api_key="dev", max_retries=0, timeout=60) as c:
                by_text = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                               logprobs=2, extra_body={"ignore_eos": True})
                by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
                return by_text, by_ids

        by_text, by_ids = await asyncio.to_thread(sync_calls)
        assert by_text.choices[0].text == by_ids.choices[0].text
        assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 8
        assert len(by_text.choices[0].logprobs.tokens) == 8 and all(1 <= len(t) <= 2 for t in by_text.choices[0].logprobs.top_logprobs)  # pieces may collide


async def test_disconnect_mid_stream_cancels_and_frees_kv(kafka_bootstrap: str, tiny_dir: Path) -> None:
    async with platform(kafka_bootstrap, tiny_dir, step_sleep_s=0.02) as (edge, engine, bus, layout, _):
        total = engine.kv.num_blocks
        control = bus.consumer([layout.control_topic], group_id=None, start_from="latest")
        await control.start()
        cancels: list[Cancel] = []

        async def watch() -> None:
            while True:
                for rec in await control.getmany(timeout_ms=100):
                    msg = decode(rec.value)
                    if isinstance(msg, Cancel):
                        cancels.append(msg)

        watcher = asyncio.create_task(watch())
        try:
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True,
                    "ignore_eos": True}
            got: list[bytes] = []
            async with aiohttp.ClientSession() as h:
                async def go() -> None:
                    async with h.post(f"http://127.0.0.1:{edge.openai_port}/v1/chat/completions", json=body) as r:
                        async for chunk in r.content.iter_any():
                            got.append(chunk)

                task = asyncio.create_task(go())
                await wait_until(lambda: len(got) >= 4 and engine.kv.num_free_blocks < total, timeout=60)
                rid = next(iter(edge.admission.router.streams))
                task.cancel()  # the HTTP client goes away mid-stream
                await asyncio.gather(task, return_exceptions=True)
            await wait_until(lambda: any(c.request_id == rid and c.reason == "disconnect" for c in cancels), timeout=30)
            await wait_until(lambda: engine.kv.num_free_blocks == total, timeout=30)  # the worker freed its KV
            assert not edge.admission.router.streams
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await control.stop()


async def test_responses_and_embeddings_over_kafka(kafka_bootstrap: str, tiny_dir: Path) -> None:
    """The Responses API and embeddings take the same Kafka path as chat: a response equals the
    chat answer of the same conversation, and an embedding's vector survives the reply topic."""
    async with contextlib.AsyncExitStack() as stack, \
            platform(kafka_bootstrap, tiny_dir) as (edge, _engine, _, _, _encoder):
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{edge.openai_port}/v1", api_key="dev",
                                    max_retries=0, timeout=60)
        await stack.enter_async_context(client)
        kw = {"temperature": 0, "extra_body": {"ignore_eos": True}}
        chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **kw)
        r = await client.responses.create(model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=12, **kw)
        assert r.output_text == chat.choices[0].message.content and r.usage.output_tokens == 12
        events = [e async for e in await client.responses.create(model=MODEL, input=MESSAGES[0]["content"],
                                                                 max_output_tokens=12, stream=True, **kw)]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
        e = await client.embeddings.create(model=MODEL, input=["one", "two words"])
        assert len(e.data) == 2 and all(abs(sum(x * x for x in d.embedding) - 1) < 1e-4 for d in e.data)
        assert e.data[0].embedding != e.data[1].embedding
