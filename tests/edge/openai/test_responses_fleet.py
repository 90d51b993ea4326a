"""Background responses across two edges on one bus (memory bus, fake worker): created on one edge,
read, resumed, cancelled and deleted on the other; another key sees the 404 of an unknown id."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import openai
import pytest

from bus import MemoryBus
from devtools.fake_worker import FakeWorker, expected_text
from edge.config import EdgeConfig
from edge.server import Edge
from tests.edge.conftest import KEY, KEY_P0, MODEL, keys, wait_for
from tests.edge.openai.test_openai import chat_ids


@contextlib.asynccontextmanager
async def two_edges(encoder, step_s: float) -> AsyncIterator[tuple[FakeWorker, dict[str, openai.AsyncOpenAI],
                                                                   openai.AsyncOpenAI]]:
    async with MemoryBus("memory://") as bus, FakeWorker(bus, MODEL, step_s=step_s) as fw, \
            contextlib.AsyncExitStack() as stack:
        clients = {}
        for name in ("a", "b"):
            edge = await stack.enter_async_context(Edge(EdgeConfig(
                model=MODEL, port=0, openai_port=0, keys=keys(), ping_interval_s=None, edge_id=f"edge-{name}"),
                bus, encoder))
            await wait_for(lambda e=edge: e.readiness()[0])
            clients[name] = await stack.enter_async_context(openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{edge.openai_port}/v1", api_key=KEY, max_retries=0, timeout=20))
        other = await stack.enter_async_context(openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{edge.openai_port}/v1", api_key=KEY_P0, max_retries=0, timeout=20))
        yield fw, clients, other


async def test_background_runs_on_and_is_read_on_the_other_edge(encoder):
    async with two_edges(encoder, step_s=0.01) as (fw, c, other):
        want = expected_text(chat_ids(encoder, [{"role": "user", "content": "hello"}]), 30)
        r = await c["a"].responses.create(model=MODEL, input="hello", max_output_tokens=30, background=True)
        assert r.background and r.status == "in_progress"  # answered at once
        got = await c["b"].responses.retrieve(r.id)  # from the reply topic: the output so far
        assert got.id == r.id and want.startswith(got.output_text)
        await wait_for(lambda: fw.tokens_sent >= 30)
        done = await wait_for_status(c["b"], r.id, "incomplete")
        assert done.output_text == want and done.usage.output_tokens == 30
        events = [e async for e in await c["b"].responses.retrieve(r.id, stream=True, starting_after=3)]
        assert events[0].sequence_number == 4 and events[-1].type == "response.incomplete"
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(r.id)
        await c["b"].responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):  # a delete holds on every edge
            await c["a"].responses.retrieve(r.id)


async def test_cancel_on_the_other_edge_stops_the_worker(encoder):
    async with two_edges(encoder, step_s=0.05) as (fw, c, other):
        r = await c["a"].responses.create(model=MODEL, input="hello", max_output_tokens=400, background=True)
        with pytest.raises(openai.NotFoundError):
            await other.responses.cancel(r.id)
        await wait_for(lambda: fw.tokens_sent >= 2)
        cancelled = await c["b"].responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        await wait_for(lambda: any(x.reason == "client" for x in fw.cancels))
        got = await wait_for_status(c["a"], r.id, "cancelled")
        assert got.usage is None or got.usage.output_tokens < 400
        with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
            await c["b"].responses.cancel((await c["b"].responses.create(model=MODEL, input="x",
                                                                          max_output_tokens=1)).id)


async def wait_for_status(client: openai.AsyncOpenAI, rid: str, status: str):
    got = []

    async def check() -> bool:
        got.append(await client.responses.retrieve(rid))
        return got[-1].status == status
    await wait_for(check, timeout=10, interval=0.05)
    return got[-1]
