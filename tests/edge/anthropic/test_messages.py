"""The Anthropic Messages API through the official ``anthropic`` SDK: memory bus, the fake worker
(whose output is a pure function of the prompt, ``expected_text``), on the OpenAI API's port."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest

from bus import ChatMessage
from devtools.fake_worker import FakeWorker, expected_text
from edge.server import Edge
from tests.edge.conftest import KEY, MODEL, running_edge

HELLO: list[Any] = [{"role": "user", "content": "hello there"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER,
                     "cache_control": {"type": "ephemeral"}},
                    {"name": "add", "description": "Add", "input_schema": {"type": "object"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def base_url(edge: Edge) -> str:
    return f"http://127.0.0.1:{edge.openai_port}"


@contextlib.asynccontextmanager
async def api(encoder, **kw) -> AsyncIterator[tuple[Edge, FakeWorker, anthropic.AsyncAnthropic]]:
    async with running_edge(encoder, openai_port=0, **kw) as (edge, fw):
        assert fw is not None
        async with anthropic.AsyncAnthropic(base_url=base_url(edge), api_key=KEY, max_retries=0, timeout=20) as client:
            yield edge, fw, client


def chat_ids(encoder, messages: list[dict]) -> tuple[int, ...]:
    return tuple(encoder.chat_ids([ChatMessage(m["role"], m["content"]) for m in messages]))


def pieces(text: str, size: int = 7):
    """A fake worker's ``token_text`` writing ``text`` in chunks of ``size`` characters."""
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    return (lambda _ids, i: chunks[i] if i < len(chunks) else ""), len(chunks)


async def raw_events(edge: Edge, body: dict, headers: dict | None = None) -> list[tuple[str, dict, float]]:
    """(event name, data, arrival) of every SSE event of a streamed request, read off the wire."""
    out: list[tuple[str, dict, float]] = []
    async with aiohttp.ClientSession() as h, \
            h.post(f"{base_url(edge)}/v1/messages", json={**body, "stream": True},
                   headers=headers or {"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        name = ""
        async for line in r.content:
            if line.startswith(b"event: "):
                name = line[7:].strip().decode()
            elif line.startswith(b"data: "):
                out.append((name, orjson.loads(line[6:]), time.monotonic()))
    return out


async def test_create_and_stream_agree(encoder) -> None:
    async with api(encoder) as (edge, fw, client):
        system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
        ids = chat_ids(encoder, [{"role": "system", "content": "Be brief."}, *HELLO])
        want = expected_text(ids, 9)
        m = await client.messages.create(model=MODEL, max_tokens=9, system=system, messages=HELLO,
                                         metadata={"user_id": "u1"},
                                         # the SDK no longer names the sampling fields; clients still send them
                                         extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
        assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == want  # type: ignore[union-attr]
        assert m.stop_reason == "max_tokens" and m.stop_sequence is None
        assert (m.usage.input_tokens, m.usage.output_tokens, m.usage.cache_read_input_tokens) == (len(ids), 9, 0)
        seen = fw.seen[-1]
        assert seen.messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "hello there"))
        assert (seen.sampling.max_tokens, seen.sampling.temperature, seen.sampling.top_p, seen.sampling.top_k) \
            == (9, 0.5, 0.9, 5)
        assert seen.tenant == "acme" and seen.prompt_token_ids == ids

        # the SDK's stream helper: text deltas, then the same final message
        async with client.messages.stream(model=MODEL, max_tokens=9, system="Be brief.", messages=HELLO) as s:
            texts = [t async for t in s.text_stream]
            final = await s.get_final_message()
        assert "".join(texts) == want and len(texts) == 9
        assert final.content[0].text == want and final.stop_reason == "max_tokens"  # type: ignore[union-attr]
        assert final.usage.output_tokens == 9 and final.usage.input_tokens == len(ids)

        # the raw events, as Anthropic sends them: each named as its data's type, ping after message_start
        events = await raw_events(edge, {"model": MODEL, "max_tokens": 3, "messages": HELLO})
        assert all(name == data["type"] for name, data, _ in events)
        kinds = [name for name, _, _ in events]
        assert kinds == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * 3 \
            + ["content_block_stop", "message_delta", "message_stop"]
        start = events[0][1]["message"]
        assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == len(
            chat_ids(encoder, HELLO))
        assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        assert {e[1]["delta"]["type"] for e in events[3:6]} == {"text_delta"}
        assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert events[-2][1]["usage"]["output_tokens"] == 3


async def test_end_turn_and_stop_sequence(encoder) -> None:
    async with api(encoder, worker_kw={"stop_after": 2}) as (edge, fw, client):
        m = await client.messages.create(model=MODEL, max_tokens=50, messages=HELLO)
        assert m.stop_reason == "end_turn" and m.usage.output_tokens == 2
        m = await client.messages.create(model=MODEL, max_tokens=50, messages=HELLO, stop_sequences=["\n\nHuman:"])
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == "\n\nHuman:"
        assert fw.seen[-1].sampling.stop == ("\n\nHuman:",)


async def test_forced_tool_gives_a_parsed_tool_use_block(encoder) -> None:
    text_of, n = pieces(CALL)
    async with api(encoder, worker_kw={"token_text": text_of, "stop_after": n}) as (edge, fw, client):
        m = await client.messages.create(model=MODEL, max_tokens=200, messages=HELLO, tools=TOOLS,
                                         tool_choice={"type": "tool", "name": "get_weather"})
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
        call = m.content[0]
        assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
        assert call.input == {"city": "Paris", "unit": "c"}
        # grammar-enforced like chat: the forcing constraint went to the worker with the request
        assert fw.seen[-1].sampling.guided is not None
        prompt = encoder.tokenizer.decode(list(fw.seen[-1].prompt_token_ids))
        assert "get_weather" in prompt and "input_schema" not in prompt  # the tools as the template's functions

        # streamed: the SDK accumulates the input_json_delta fragments into the same input
        async with client.messages.stream(model=MODEL, max_tokens=200, messages=HELLO, tools=TOOLS,
                                          tool_choice={"type": "any"}) as s:
            final = await s.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[0].input == call.input  # type: ignore[union-attr]
        events = await raw_events(edge, {"model": MODEL, "max_tokens": 200, "messages": HELLO, "tools": TOOLS})
        deltas = [d["delta"] for name, d, _ in events if name == "content_block_delta"]
        assert {d["type"] for d in deltas} == {"input_json_delta"} and len(deltas) > 1
        assert json.loads("".join(d["partial_json"] for d in deltas)) == {"city": "Paris", "unit": "c"}
        starts = [d["content_block"] for name, d, _ in events if name == "content_block_start"]
        assert starts[0]["type"] == "tool_use" and starts[0]["input"] == {} and starts[0]["name"] == "get_weather"
        assert fw.seen[-1].sampling.guided is None  # auto: the model may answer in text

        # the round trip: the call and its result go back in the prompt
        history = [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                             {"type": "tool_use", "id": call.id, "name": call.name,
                                                              "input": call.input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                 "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
        m = await client.messages.create(model=MODEL, max_tokens=200, messages=history, tools=TOOLS,
                                         tool_choice={"type": "none"})
        prompt = encoder.tokenizer.decode(list(fw.seen[-1].prompt_token_ids))
        assert "sunny, 21 C" in prompt and "Paris" in prompt
        assert fw.seen[-1].sampling.guided is None
        assert [b.type for b in m.content] == ["text"] and m.stop_reason == "end_turn"  # none: calls not read


async def test_disable_parallel_tool_use_keeps_the_first_call(encoder) -> None:
    second = CALL.replace('"get_weather", "arguments": {"city": "Paris", "unit": "c"}', '"add", "arguments": {"a": 1}')
    text_of, n = pieces("Let me check.\n" + CALL + "\n" + second)
    async with api(encoder, worker_kw={"token_text": text_of, "stop_after": n}) as (edge, fw, client):
        both = await client.messages.create(model=MODEL, max_tokens=200, messages=HELLO, tools=TOOLS)
        assert [b.type for b in both.content] == ["text", "tool_use", "tool_use"]
        assert both.content[0].text.strip() == "Let me check."  # type: ignore[union-attr]
        assert [b.name for b in both.content[1:]] == ["get_weather", "add"]  # type: ignore[union-attr]
        one = await client.messages.create(model=MODEL, max_tokens=200, messages=HELLO, tools=TOOLS,
                                           tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        assert [b.type for b in one.content] == ["text", "tool_use"] and one.stop_reason == "tool_use"
        assert one.content[1].input == {"city": "Paris", "unit": "c"}  # type: ignore[union-attr]
        assert both.content[2].input == {"a": 1}  # type: ignore[union-attr]
        async with client.messages.stream(model=MODEL, max_tokens=200, messages=HELLO, tools=TOOLS,
                                          tool_choice={"type": "auto", "disable_parallel_tool_use": True}) as s:
            final = await s.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use"]
        assert final.content[1].input == {"city": "Paris", "unit": "c"}  # type: ignore[union-attr]


async def test_thinking_blocks_via_the_reasoning_parser(encoder) -> None:
    text_of, n = pieces("<think>Paris is in France.</think>\n\nIt is sunny.", 5)
    async with api(encoder, reasoning_parser="qwen3", worker_kw={"token_text": text_of, "stop_after": n}) \
            as (edge, fw, client):
        history = [*HELLO, {"role": "assistant", "content": [{"type": "thinking", "thinking": "old", "signature": "x"},
                                                             {"type": "text", "text": "Hi."}]},
                   {"role": "user", "content": "Weather?"}]
        kw: dict[str, Any] = {"model": MODEL, "max_tokens": 100, "messages": history,
                              "thinking": {"type": "enabled", "budget_tokens": 1024}}
        m = await client.messages.create(**kw, extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert m.content[0].thinking == "Paris is in France." and m.content[1].text == "It is sunny."  # type: ignore[union-attr]
        assert fw.seen[-1].messages[-2] == ChatMessage("assistant", "Hi.")  # past thinking is not in the prompt
        async with client.messages.stream(**kw) as s:
            final = await s.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == "Paris is in France."  # type: ignore[union-attr]
        events = await raw_events(edge, kw)
        assert {d["delta"]["type"] for name, d, _ in events if name == "content_block_delta"} \
            == {"thinking_delta", "text_delta"}
        hidden = await client.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 1024,
                                                                   "display": "omitted"}})
        assert [b.type for b in hidden.content] == ["thinking", "text"]
        assert hidden.content[0].thinking == "" and hidden.content[1].text == "It is sunny."  # type: ignore[union-attr]


async def test_count_tokens(encoder) -> None:
    async with api(encoder) as (edge, fw, client):
        r = await client.messages.count_tokens(model=MODEL, messages=HELLO)
        assert r.input_tokens == len(chat_ids(encoder, HELLO))
        with_system = await client.messages.count_tokens(model=MODEL, messages=HELLO, system="Be brief.")
        assert with_system.input_tokens == len(chat_ids(encoder, [{"role": "system", "content": "Be brief."}, *HELLO]))
        with_tools = await client.messages.count_tokens(model=MODEL, messages=HELLO, tools=TOOLS)
        assert with_tools.input_tokens > r.input_tokens + 20  # the tools are in the prompt
        m = await client.messages.create(model=MODEL, max_tokens=1, messages=HELLO, tools=TOOLS)
        assert m.usage.input_tokens == with_tools.input_tokens  # what create is charged for
        assert fw.seen and all(s.messages != () for s in fw.seen)  # count_tokens sent nothing to the bus
        assert len(fw.seen) == 1
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(model="nope", messages=HELLO)


async def _post(edge: Edge, body: Any, headers: dict | None = None, path: str = "/v1/messages") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as h, \
            h.post(f"{base_url(edge)}{path}", data=body if isinstance(body, bytes) else orjson.dumps(body),
                   headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})}) as r:
        return r.status, orjson.loads(await r.read())


def _shape(body: dict, kind: str) -> str:
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}, body
    return str(body["error"]["message"])


@pytest.mark.parametrize(("body", "status", "kind", "names"), [
    ({"model": MODEL, "messages": HELLO}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 0, "messages": HELLO}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     400, "invalid_request_error", "messages[0].content[1]: image blocks are not supported"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "assistant", "content": "hi"}, *HELLO]},
     400, "invalid_request_error", "messages[0].role"),
    ({"model": MODEL, "max_tokens": 5, "messages": [*HELLO, {"role": "assistant", "content": "The"}]},
     400, "invalid_request_error", "messages[1]"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}, *HELLO]},
     400, "invalid_request_error", "top-level system"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}]},
     400, "invalid_request_error", "messages[0].content[0].tool_use_id"),
    ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "x"}},
     400, "invalid_request_error", "tool_choice.name"),
    ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "tools": [{"name": "f", "input_schema": "x"}]},
     400, "invalid_request_error", "tools[0].input_schema"),
    ({"model": MODEL, "max_tokens": 5, "messages": HELLO, "temperature": "hot"}, 400, "invalid_request_error",
     "temperature"),
    ({"model": "claude-opus-4", "max_tokens": 5, "messages": HELLO}, 404, "not_found_error", "claude-opus-4"),
])
async def test_bad_inputs_are_clear_4xx_in_anthropics_shape(encoder, body, status, kind, names) -> None:
    async with running_edge(encoder, openai_port=0) as (edge, fw):
        got, reply = await _post(edge, body)
        assert got == status, reply
        assert names in _shape(reply, kind)
        assert fw is not None and fw.seen == []  # nothing reached the bus


async def test_keys_headers_and_sdk_errors(encoder) -> None:
    async with api(encoder) as (edge, fw, client):
        got, reply = await _post(edge, b"{not json")
        assert got == 400 and "not valid JSON" in _shape(reply, "invalid_request_error")
        got, reply = await _post(edge, {"model": MODEL, "max_tokens": 2, "messages": HELLO}, {"x-api-key": "wrong"})
        assert got == 401 and _shape(reply, "authentication_error")
        # Bearer (ANTHROPIC_AUTH_TOKEN, proxies) works as the key too; anthropic-beta is accepted
        async with aiohttp.ClientSession() as h, h.post(
                f"{base_url(edge)}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": HELLO},
                headers={"Authorization": f"Bearer {KEY}", "anthropic-beta": "prompt-caching-2024-07-31"}) as r:
            assert r.status == 200 and (await r.json())["usage"]["output_tokens"] == 2
        async with anthropic.AsyncAnthropic(base_url=base_url(edge), api_key="wrong", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError):
                await bad.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
        async with anthropic.AsyncAnthropic(base_url=base_url(edge), auth_token=KEY, max_retries=0) as bearer:
            assert (await bearer.messages.create(model=MODEL, max_tokens=2, messages=HELLO)).usage.output_tokens == 2
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}])
        assert e.value.status_code == 400 and "image" in e.value.message
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="nope", max_tokens=2, messages=HELLO)
        # the SDK's beta surface (what agents use): the same routes, ?beta=true and anthropic-beta headers
        beta = await client.beta.messages.create(model=MODEL, max_tokens=2, messages=HELLO,
                                                 betas=["interleaved-thinking-2025-05-14"])
        assert beta.usage.output_tokens == 2 and beta.content[0].type == "text"
        counted = await client.beta.messages.count_tokens(model=MODEL, messages=HELLO, betas=["token-counting-2024-11-01"])
        assert counted.input_tokens == len(chat_ids(encoder, HELLO))


async def test_key_limit_is_429_rate_limit_error(encoder) -> None:
    from tests.edge.conftest import keys

    async with api(encoder, keys=keys(max_streams=1), worker_kw={"step_s": 0.05}) as (edge, fw, client):
        async with client.messages.stream(model=MODEL, max_tokens=40, messages=HELLO) as s:
            async for _ in s.text_stream:
                break  # one stream open: the key's one slot is taken
            got, reply = await _post(edge, {"model": MODEL, "max_tokens": 2, "messages": HELLO})
            assert got == 429 and _shape(reply, "rate_limit_error")


PREFILL_S = 0.6
SEND_S = 0.1  # one write: message_start, ping and the first delta leave together


async def test_message_start_leaves_with_the_first_token(encoder) -> None:
    async with running_edge(encoder, openai_port=0, worker_kw={"first_token_s": PREFILL_S}) as (edge, _):
        sent = time.monotonic()
        events = await raw_events(edge, {"model": MODEL, "max_tokens": 3, "messages": HELLO})
    assert events[0][0] == "message_start"
    first_any = events[0][2]
    first_token = next(t for name, d, t in events if name == "content_block_delta")
    assert first_any - sent >= 0.8 * (first_token - sent), (first_any - sent, first_token - sent)
    assert first_token - first_any <= SEND_S, "message_start left before the first token"
    assert first_token - sent >= PREFILL_S * 0.9  # the prefill delay really happened


@pytest.mark.parametrize(("code", "status", "kind"), [("internal", 500, "api_error"),
                                                      ("overloaded", 529, "overloaded_error")])
async def test_a_worker_error_is_anthropics_error(encoder, code: str, status: int, kind: str) -> None:
    async with running_edge(encoder, openai_port=0, worker_kw={"error": code}) as (edge, _):
        got, reply = await _post(edge, {"model": MODEL, "max_tokens": 5, "messages": HELLO})
        assert got == status and "fake error" in _shape(reply, kind)
        events = await raw_events(edge, {"model": MODEL, "max_tokens": 5, "messages": HELLO})
        # after the 200, the error is the stream's last event, in the same shape
        assert [name for name, _, _ in events][-1] == "error"
        assert "fake error" in _shape(events[-1][1], kind)


async def test_server_tools_are_accepted_not_offered_and_models_list(encoder) -> None:
    async with api(encoder) as (edge, fw, client):
        tools: list[Any] = [TOOLS[0], {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]
        m = await client.messages.create(model=MODEL, max_tokens=2, messages=HELLO, tools=tools)
        assert m.usage.output_tokens == 2
        prompt = encoder.tokenizer.decode(list(fw.seen[-1].prompt_token_ids))
        assert "get_weather" in prompt and "web_search" not in prompt
        # the anthropic SDK's models.list / retrieve read the edge's /v1/models
        models = [x async for x in client.models.list()]
        assert [x.id for x in models] == [MODEL] and models[0].type == "model"
        assert (await client.models.retrieve(MODEL)).display_name == MODEL


async def test_a_coding_agent_style_request_is_accepted(encoder) -> None:
    """What Claude-style coding agents send: cached system blocks, a strict-schema tool, a huge
    max_tokens, thinking, beta headers and query, fields this server does not know."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
              "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}}, "required": ["command"]}
    body = {"model": MODEL, "max_tokens": 32000, "stream": True, "temperature": 1,
            "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>context</system-reminder>"},
                {"type": "text", "text": "list the files", "cache_control": {"type": "ephemeral"}}]}],
            "tools": [{"name": "Bash", "description": "Run a command", "input_schema": schema}],
            "metadata": {"user_id": "user_abc_account_x_session_y"},
            "thinking": {"type": "enabled", "budget_tokens": 4000},
            "context_management": {"edits": []}, "container": None}
    async with running_edge(encoder, openai_port=0) as (edge, fw):
        async with aiohttp.ClientSession() as h, h.post(
                f"{base_url(edge)}/v1/messages?beta=true", json=body,
                headers={"x-api-key": KEY, "anthropic-version": "2023-06-01",
                         "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}) as r:
            assert r.status == 200, await r.text()
            raw = await r.read()
        assert b"event: message_stop" in raw
        assert fw is not None
        seen = fw.seen[-1]
        # max_tokens past the context is clamped to what fits, not refused
        assert seen.sampling.max_tokens == encoder.context_len - len(seen.prompt_token_ids)
        prompt = encoder.tokenizer.decode(list(seen.prompt_token_ids))
        assert "<system-reminder>context</system-reminder>\nlist the files" in prompt and "Bash" in prompt
