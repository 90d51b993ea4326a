"""``--reasoning-parser`` (``<think>…</think>`` -> ``reasoning_content`` / reasoning items) and
``parallel_tool_calls``, through the official SDK against a fake worker that writes a scripted
output (tags split across chunks on purpose)."""

from __future__ import annotations

import pytest

from edge.chat.reasoning import ReasoningStream, split
from tests.edge.conftest import MODEL
from tests.edge.openai.test_openai import api

THINK = ["<thi", "nk>", "let me ", "think", "</th", "ink>", "\n", "\n", "The ", "answer"]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": %d, "b": 2}}\n</tool_call>\n'
TWO_CALLS = [CALL % 1, CALL % 7]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
FLAT = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
HI = [{"role": "user", "content": "hi"}]


def script(parts: list[str]):
    return {"token_text": lambda _ids, i: parts[i] if i < len(parts) else ""}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_split_is_the_same_at_any_chunking(parser, step):
    text = "<think>a <b> c</think>\n\nthe </think> answer"
    rs = ReasoningStream(parser)
    parts = [p for i in range(0, len(text), step) for p in rs.feed(text[i:i + step])] + rs.finish()
    assert "".join(t for k, t in parts if k == "reasoning") == "a <b> c"
    assert "".join(t for k, t in parts if k == "content") == "the </think> answer"


def test_parsers_differ_on_an_output_without_tags():
    assert split("qwen3", "plain answer") == (None, "plain answer")  # thinking off: all answer
    assert split("deepseek_r1", "still thinking") == ("still thinking", "")  # the template opened <think>
    assert split("deepseek_r1", "why</think>so") == ("why", "so")


async def test_reasoning_content_on_chat_streamed_and_not(encoder):
    async with api(encoder, reasoning_parser="qwen3", worker_kw=script(THINK)) as (_, _fw, client):
        r = await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=len(THINK))
        msg = r.choices[0].message
        assert msg.content == "The answer" and msg.model_extra["reasoning_content"] == "let me think"
        reasoning, content = "", ""
        async for c in await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=len(THINK),
                                                            stream=True):
            if c.choices:
                reasoning += (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                content += c.choices[0].delta.content or ""
        assert (reasoning, content) == ("let me think", "The answer")


async def test_reasoning_items_on_responses_streamed_and_not(encoder):
    async with api(encoder, reasoning_parser="qwen3", worker_kw=script(THINK)) as (_, _fw, client):
        r = await client.responses.create(model=MODEL, input="hi", max_output_tokens=len(THINK))
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "let me think" and r.output_text == "The answer"
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        events = [e async for e in await client.responses.create(model=MODEL, input="hi",
                                                                 max_output_tokens=len(THINK), stream=True)]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "let me think"
        assert [e.text for e in events if e.type == "response.reasoning_text.done"] == ["let me think"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "The answer"


async def test_reasoning_is_off_by_default(encoder):
    async with api(encoder, worker_kw=script(THINK)) as (_, _fw, client):
        r = await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=len(THINK))
        assert r.choices[0].message.content == "".join(THINK)
        assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


async def test_parallel_tool_calls_false_keeps_the_first_call(encoder):
    async with api(encoder, worker_kw=script(TWO_CALLS)) as (_, _fw, client):
        kw = dict(model=MODEL, messages=HI, tools=TOOLS, max_tokens=2)
        both = await client.chat.completions.create(**kw)
        assert [c.function.arguments for c in both.choices[0].message.tool_calls] == ['{"a": 1, "b": 2}',
                                                                                      '{"a": 7, "b": 2}']
        one = await client.chat.completions.create(**kw, parallel_tool_calls=False)
        assert [c.function.arguments for c in one.choices[0].message.tool_calls] == ['{"a": 1, "b": 2}']
        streamed: dict[int, str] = {}
        async for c in await client.chat.completions.create(**kw, parallel_tool_calls=False, stream=True):
            for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                streamed[tc.index] = streamed.get(tc.index, "") + (tc.function.arguments or "")
        assert streamed == {0: '{"a": 1, "b": 2}'}

        r = await client.responses.create(model=MODEL, input="hi", tools=FLAT, max_output_tokens=2,
                                          parallel_tool_calls=False)
        assert [o.arguments for o in r.output if o.type == "function_call"] == ['{"a": 1, "b": 2}']
        r = await client.responses.create(model=MODEL, input="hi", tools=FLAT, max_output_tokens=2)
        assert len([o for o in r.output if o.type == "function_call"]) == 2


async def test_the_sdk_stream_helper_parses_reasoning_then_function_calls(encoder):
    """``client.responses.stream(...)`` (the SDK's accumulating helper, stricter than a raw event
    list: it rebuilds every item from its deltas) over reasoning followed by two tool calls."""
    parts = THINK[:7] + TWO_CALLS
    async with api(encoder, reasoning_parser="qwen3", worker_kw=script(parts)) as (_, _fw, client):
        async with client.responses.stream(model=MODEL, input="hi", tools=FLAT,
                                           max_output_tokens=len(parts)) as stream:
            events = [e async for e in stream]
        # the fake worker ends every request at max_tokens: the SDK's get_final_response() wants
        # response.completed, so the final object is read from the closing response.incomplete
        # (the tiny-model test in test_openai_responses reads get_final_response()).
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
        final = events[-1].response
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "let me think"
        calls = [o for o in final.output if o.type == "function_call"]
        assert [o.type for o in final.output] == ["reasoning", "function_call", "function_call"]
        assert [c.arguments for c in calls] == ['{"a": 1, "b": 2}', '{"a": 7, "b": 2}']
        for c in calls:  # each call's argument deltas rebuild its arguments
            assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                           and e.item_id == c.id) == c.arguments
        assert final.output[0].content[0].text == "let me think"
