"""The OpenAI-compatible API through the official ``openai`` SDK (sync and async): memory bus, the
fake worker (whose output is a pure function of the prompt, ``expected_text``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import openai
import orjson
import pytest

from bus import ChatMessage
from devtools.fake_worker import FakeWorker, expected_text
from edge.server import Edge
from tests.edge.conftest import KEY, MODEL, keys, running_edge
from tests.waiting import wait_until

HELLO = [{"role": "user", "content": "hello there"}]


def base_url(edge: Edge) -> str:
    return f"http://127.0.0.1:{edge.openai_port}/v1"


@contextlib.asynccontextmanager
async def api(encoder, key: str = KEY, **kw) -> AsyncIterator[tuple[Edge, FakeWorker | None, openai.AsyncOpenAI]]:
    async with running_edge(encoder, openai_port=0, **kw) as (edge, fw):
        async with openai.AsyncOpenAI(base_url=base_url(edge), api_key=key, max_retries=0, timeout=20) as client:
            yield edge, fw, client


def chat_ids(encoder, messages: list[dict]) -> tuple[int, ...]:
    return tuple(encoder.chat_ids([ChatMessage(m["role"], m["content"]) for m in messages]))


async def test_models_list_from_heartbeats(encoder):
    async with api(encoder) as (edge, _, client):
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert models.data[0].object == "model" and models.data[0].owned_by == "lockgate"
        assert (await client.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("nope")
    async with api(encoder, worker=False) as (edge, _, client):
        assert (await client.models.list()).data == []  # no live worker: nothing served


async def test_chat_non_streaming_and_streaming_agree(encoder):
    async with api(encoder) as (edge, fw, client):
        want = expected_text(chat_ids(encoder, HELLO), 9)
        r = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=9, temperature=0)
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
        assert r.choices[0].finish_reason == "length"
        n_prompt = len(chat_ids(encoder, HELLO))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 9, n_prompt + 9)
        assert r.usage.prompt_tokens_details.cached_tokens == 0

        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=HELLO, max_completion_tokens=9, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        assert {c.id for c in chunks} == {chunks[0].id} and {c.created for c in chunks} == {chunks[0].created}
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
        assert all(c.usage is None for c in chunks[:-1])
        assert fw.seen[-1].sampling.max_tokens == 9 and fw.seen[-1].tenant == "acme"


async def test_sync_client_chat_completions_and_max_tokens_1(encoder):
    async with running_edge(encoder, openai_port=0) as (edge, fw):
        def run() -> tuple:
            with openai.OpenAI(base_url=base_url(edge), api_key=KEY, max_retries=0, timeout=20) as c:
                one = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
                streamed = list(c.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, stream=True))
                plain = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=5)
                by_ids = c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4)
                return one, streamed, plain, by_ids

        one, streamed, plain, by_ids = await asyncio.to_thread(run)
        assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
        assert one.choices[0].message.content == expected_text(chat_ids(encoder, HELLO), 1)
        want = expected_text(tuple(encoder.text_ids("Once upon")), 5)
        assert plain.object == "text_completion" and plain.choices[0].text == want
        assert "".join(c.choices[0].text for c in streamed) == want
        assert len({c.id for c in streamed}) == 1 and streamed[0].id.startswith("cmpl-")
        assert by_ids.choices[0].text == expected_text((5, 6, 7), 4) and by_ids.usage.prompt_tokens == 3
        assert fw.seen[-1].prompt_token_ids == (5, 6, 7)


async def test_text_parts_developer_role_and_unknown_fields(encoder):
    async with api(encoder) as (edge, fw, client):
        msgs = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                {"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, user="u1",
                                                 extra_body={"top_k": 5, "ignore_eos": True, "stop_token_ids": [7],
                                                             "some_future_field": {"x": 1}})
        assert r.usage.completion_tokens == 2
        seen = fw.seen[-1]
        assert seen.messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "hi"))
        assert (seen.sampling.top_k, seen.sampling.ignore_eos, seen.sampling.stop_token_ids) == (5, True, (7,))


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_error_statuses_and_bodies(encoder):
    async with api(encoder) as (edge, _, client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model=MODEL, messages=HELLO, temperature=-1)
        err = _error(e.value)
        assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model=MODEL, messages=HELLO, n=9)  # at most 8 choices
        assert _error(e.value)["param"] == "n"
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=MODEL, prompt="x", echo=True, logprobs=1)  # no prompt logprobs
        assert _error(e.value)["param"] == "echo"
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
        assert _error(e.value)["param"] == "messages[0].role"
        # prompt + the output limit past the context: 400 naming it, not a silent clamp (#38)
        for call in (lambda: client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10**9),
                     lambda: client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=10**9),
                     lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=10**9)):
            with pytest.raises(openai.BadRequestError) as e:
                await call()
            err = _error(e.value)
            assert err["param"] == "max_tokens" and "context length" in err["message"], err
        ok = await client.completions.create(model=MODEL, prompt="x")  # no limit given: the default fits
        assert ok.choices
        with pytest.raises(openai.NotFoundError) as e:
            await client.chat.completions.create(model="gpt-4o", messages=HELLO)
        err = _error(e.value)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        async with openai.AsyncOpenAI(base_url=base_url(edge), api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as e:
                await bad.chat.completions.create(model=MODEL, messages=HELLO)
            assert _error(e.value)["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        metrics = edge.metrics.render().decode()
        assert 'lockgate:edge_rejections_total{api="openai",reason="unauthorized"}' in metrics
        assert 'api="openai",reason="invalid_request"' in metrics


async def test_rate_limited_429_with_retry_after(encoder):
    async with api(encoder, keys=keys(requests_per_min=1)) as (edge, _, client):
        await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
        err = _error(e.value)
        assert err["code"] == "rate_limit_exceeded" and err["param"] == "requests_per_min"
        assert int(e.value.response.headers["Retry-After"]) >= 1


async def test_no_live_worker_is_503_with_retry_after(encoder):
    async with api(encoder, worker=False) as (edge, _, client):
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model=MODEL, messages=HELLO)
        assert e.value.status_code == 503 and _error(e.value)["code"] == "overloaded"
        assert int(e.value.response.headers["Retry-After"]) >= 1


async def test_worker_error_is_a_status_or_a_stream_error_event(encoder):
    async with api(encoder, worker_kw={"error": "expired"}) as (edge, _, client):
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model=MODEL, messages=HELLO)
        assert e.value.status_code == 504 and _error(e.value)["code"] == "expired"
        stream = await client.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
        with pytest.raises(openai.APIError) as e2:
            async for _ in stream:
                pass
        assert e2.value.body["code"] == "expired"
        # on the wire: the error event, then [DONE]
        async with aiohttp.ClientSession() as h, h.post(
                f"{base_url(edge)}/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                json={"model": MODEL, "messages": HELLO, "stream": True}) as r:
            status, text = r.status, await r.text()
        events = [e for e in text.split("\n\n") if e]
        assert status == 200 and events[-1] == "data: [DONE]"
        assert orjson.loads(events[-2].removeprefix("data: "))["error"]["code"] == "expired"


async def _disconnect_cancels(encoder, stream: bool) -> None:
    async with running_edge(encoder, openai_port=0, worker_kw={"step_s": 0.05}) as (edge, fw):
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 1000, "stream": stream}
        async with aiohttp.ClientSession() as h:
            async def go() -> None:
                async with h.post(f"{base_url(edge)}/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEY}"}) as r:
                    async for _ in r.content.iter_any():
                        pass

            task = asyncio.create_task(go())
            await wait_until(lambda: fw.running and fw.tokens_sent >= 3)
            rid = next(iter(fw.running))
            task.cancel()  # the client goes away: its connection closes
            await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: any(c.request_id == rid for c in fw.cancels))
        assert [c.reason for c in fw.cancels if c.request_id == rid] == ["disconnect"]
        await wait_until(lambda: not fw.running and not edge.admission.router.streams)  # the worker let it go
        assert "lockgate:edge_streams 0.0" in edge.metrics.render().decode()


async def test_disconnect_mid_stream_cancels(encoder):
    await _disconnect_cancels(encoder, stream=True)


async def test_disconnect_while_waiting_for_a_non_streamed_answer_cancels(encoder):
    await _disconnect_cancels(encoder, stream=False)


async def test_openai_off_by_default_and_ws_untouched(encoder):
    async with running_edge(encoder) as (edge, _):
        assert edge.openai_port is None and edge.openai is None


async def test_bench_serve_openai_target(encoder, tmp_path):
    """`lockgate bench serve --openai-url`: the seeded workload over streaming chat completions, every
    request its exact output length (ignore_eos + max_tokens), counted from the usage chunk."""
    import math

    from benchmarks.serving.loadgen import LengthMix
    from benchmarks.serving.serve import BenchConfig, bench

    async with running_edge(encoder, openai_port=0, keys=None) as (edge, fw):
        cfg = BenchConfig(target="openai", url=base_url(edge), rates=(math.inf,), num_prompts=6, out_dir=tmp_path,
                          plots=False, warmup=0, mix=LengthMix().scaled(prompt_max=64, output_max=16))
        result = await bench(cfg)
    stats = result["runs"][0]["stats"]
    assert stats["completed"] == 6 and stats["failed"] == 0
    rows = result["runs"][0]["requests"]
    assert sorted(r["output_tokens"] for r in rows) == sorted(r.sampling.max_tokens for r in fw.seen)
    assert all(r["ttft_ms"] is not None and r["prompt_tokens"] > 0 for r in rows)
    assert (tmp_path / "results.json").exists()


async def test_sampling_controls_reach_the_worker(encoder):
    async with api(encoder) as (edge, fw, client):
        await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, presence_penalty=0.5,
                                             frequency_penalty=-0.5, logit_bias={"5": -100}, seed=-1,
                                             extra_body={"min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1,
                                                         "top_k": -1})
        sp = fw.seen[-1].sampling
        assert (sp.presence_penalty, sp.frequency_penalty, sp.logit_bias) == (0.5, -0.5, ((5, -100.0),))
        assert (sp.min_p, sp.repetition_penalty, sp.min_tokens, sp.top_k) == (0.1, 1.2, 1, 0)
        assert sp.seed == (1 << 63) - 1
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model=MODEL, messages=HELLO, logit_bias={"999999": 1})
        assert _error(e.value)["param"] == "logit_bias"


async def test_the_seed_used_is_returned_as_an_extension_field(encoder):
    async with api(encoder) as (edge, fw, client):
        r = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0.8)
        assigned = r.model_extra["seed"]
        assert isinstance(assigned, int) and fw.seen[-1].sampling.seed == assigned
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=2, temperature=0.8, seed=99, stream=True)]
        assert {c.model_extra["seed"] for c in chunks} == {99} and fw.seen[-1].sampling.seed == 99
