"""LoRA adapters at the edge (docs/lora.md): a request whose ``model`` names an adapter goes to the
served model's workers with ``lora=<name>``; ``/v1/models`` lists the adapters with their
``parent`` (vLLM's shape), learnt from the live workers' heartbeats or the edge's own
``--lora-modules``; an unknown name is still a 404."""

from __future__ import annotations

import openai
import pytest

from devtools.fake_worker import expected_text
from tests.edge.conftest import MODEL
from tests.edge.openai.test_openai import HELLO, api, chat_ids


async def test_adapters_from_heartbeats_route_and_list(encoder):
    async with api(encoder, worker_kw={"loras": ("sql", "chat")}) as (edge, fw, client):
        models = (await client.models.list()).data
        assert [m.id for m in models] == [MODEL, "sql", "chat"]
        assert [getattr(m, "parent", None) for m in models] == [None, MODEL, MODEL]
        assert (await client.models.retrieve("sql")).parent == MODEL

        r = await client.chat.completions.create(model="sql", messages=HELLO, max_tokens=3)
        assert r.choices[0].message.content == expected_text(chat_ids(encoder, HELLO), 3)
        assert r.model == "sql"  # the answer names the adapter asked for, as vLLM's does
        seen = fw.seen[-1]
        assert (seen.model, seen.lora) == (MODEL, "sql")
        await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2)
        assert fw.seen[-1].lora is None  # the base model names no adapter
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=HELLO, max_tokens=3)


async def test_adapters_named_by_the_edge_flag(encoder):
    async with api(encoder, lora_modules=("tenant-a",)) as (edge, fw, client):
        assert [m.id for m in (await client.models.list()).data] == [MODEL, "tenant-a"]
        await client.completions.create(model="tenant-a", prompt="Once upon", max_tokens=2)
        assert fw.seen[-1].lora == "tenant-a"


async def test_responses_api_routes_an_adapter(encoder):
    async with api(encoder, worker_kw={"loras": ("sql",)}) as (edge, fw, client):
        r = await client.responses.create(model="sql", input="hello there", max_output_tokens=3)
        assert r.usage.output_tokens == 3
        assert (fw.seen[-1].model, fw.seen[-1].lora) == (MODEL, "sql")


async def test_anthropic_messages_route_an_adapter(encoder):
    """``/v1/messages`` maps ``model`` to an adapter as the OpenAI routes do; the answer names it."""
    import anthropic

    from tests.edge.anthropic.test_messages import base_url
    from tests.edge.conftest import KEY

    async with api(encoder, worker_kw={"loras": ("sql",)}) as (edge, fw, _):
        async with anthropic.AsyncAnthropic(base_url=base_url(edge), api_key=KEY, max_retries=0, timeout=20) as c:
            m = await c.messages.create(model="sql", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
            assert m.model == "sql" and m.usage.output_tokens == 3
            assert (fw.seen[-1].model, fw.seen[-1].lora) == (MODEL, "sql")
            n = await c.messages.count_tokens(model="sql", messages=[{"role": "user", "content": "hi"}])
            assert n.input_tokens > 0
            with pytest.raises(anthropic.NotFoundError):
                await c.messages.create(model="nope", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
