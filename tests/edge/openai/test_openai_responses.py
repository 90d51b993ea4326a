"""``/v1/responses`` through the official SDK: memory bus and the fake worker (output a pure function
of the prompt, ``expected_text``) for the shapes, the event sequence, the store and bad input; a real
worker on the tiny model for function calls and text.format."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from bus import ChatMessage
from devtools.fake_worker import expected_text
from tests.edge.conftest import MODEL
from tests.edge.openai.test_openai import api
from tests.engine_workers.engine.test_guided import MODEL as TINY
from tests.engine_workers.engine.test_guided import platform, sdk


def ids(encoder, msgs: list[tuple[str, str]]) -> tuple[int, ...]:
    return tuple(encoder.chat_ids([ChatMessage(r, c) for r, c in msgs]))


async def test_text_response_streamed_and_not_agree(encoder):
    async with api(encoder) as (_, fw, client):
        want = expected_text(ids(encoder, [("system", "Be brief."), ("user", "hello there")]), 9)
        r = await client.responses.create(model=MODEL, input="hello there", instructions="Be brief.",
                                          max_output_tokens=9)
        assert r.object == "response" and r.id.startswith("resp_")
        assert r.output_text == want and r.output[0].type == "message" and r.output[0].role == "assistant"
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 9 and r.usage.input_tokens == len(fw.seen[-1].prompt_token_ids)
        assert r.instructions == "Be brief." and r.max_output_tokens == 9

        events = [e async for e in await client.responses.create(
            model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}],
            instructions="Be brief.", max_output_tokens=9, stream=True)]
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.incomplete"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
        final = events[-1].response
        assert final.output_text == want and final.usage.output_tokens == 9


async def test_store_previous_response_id_get_delete_and_store_false(encoder):
    async with api(encoder) as (_, fw, client):
        first = await client.responses.create(model=MODEL, input="hi", instructions="Sys.", max_output_tokens=3)
        got = await client.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == first.output_text
        follow = await client.responses.create(model=MODEL, input="and then?", previous_response_id=first.id,
                                               max_output_tokens=3)
        # the stored conversation goes first; the first turn's instructions are not carried over
        assert fw.seen[-1].messages == (ChatMessage("user", "hi"), ChatMessage("assistant", first.output_text),
                                        ChatMessage("user", "and then?"))
        assert follow.previous_response_id == first.id
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
        assert e.value.body["param"] == "previous_response_id"
        private = await client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(private.id)
        with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
            await client.responses.cancel(follow.id)


async def test_sampling_fields_reach_the_bus(encoder):
    """``temperature``, ``top_p`` and ``max_output_tokens`` are the bus request's sampling, as chat's are."""
    async with api(encoder) as (_, fw, client):
        await client.responses.create(model=MODEL, input="x", temperature=0.3, top_p=0.7, max_output_tokens=5)
        s = fw.seen[-1].sampling
        assert (s.temperature, s.top_p, s.max_tokens) == (0.3, 0.7, 5)


async def test_function_call_items_become_tool_turns(encoder):
    async with api(encoder) as (_, fw, client):
        tools = [{"type": "function", "name": "add", "description": "Add", "parameters": {"type": "object"}}]
        await client.responses.create(model=MODEL, max_output_tokens=2, tools=tools, tool_choice="none", input=[
            {"role": "user", "content": "2 + 3?"},
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "5"}])
        prompt = encoder.tokenizer.decode(list(fw.seen[-1].prompt_token_ids))
        # the call and its result are in the prompt in the model's call format (Hermes for the tiny model)
        assert '"name": "add"' in prompt and "<tool_response>" in prompt and "5" in prompt


@pytest.mark.parametrize(("kw", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": "x"}] * 513}, "input"),
    ({"input": ["just a string"]}, "input[0]"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "background": "yes"}, "background"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"input": "x", "include": "message.output_text.logprobs"}, "include"),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": 3}}}, "text.format.json_schema.schema"),
])
async def test_bad_input_is_a_400_naming_the_field(encoder, kw, param):
    async with api(encoder) as (_, _fw, client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model=MODEL, **kw)
        assert e.value.body["param"] == param, e.value.body
        r = await client.responses.create(model=MODEL, input="still serving", max_output_tokens=1)
        assert r.usage.output_tokens == 1


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
FLAT = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
        {"type": "function", "name": "get_time", "description": "Time in a city", "parameters": WEATHER}]


async def test_function_calls_and_text_format_on_the_tiny_model(tiny_model_dir: str) -> None:
    async with platform(tiny_model_dir) as (edge, _), sdk(edge) as client:
        base = dict(model=TINY, input="Weather in Paris?", tools=FLAT, max_output_tokens=80, temperature=1.0)
        r = await client.responses.create(**base, tool_choice="required", extra_body={"seed": 0})
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and r.status == "completed"
        for c in calls:
            assert c.name in ("get_weather", "get_time") and c.call_id.startswith("call_")
            jsonschema.validate(json.loads(c.arguments), WEATHER)
        named = await client.responses.create(**base, tool_choice={"type": "function", "name": "get_time"}, extra_body={"seed": 1},
                                              parallel_tool_calls=False)
        assert [o.name for o in named.output if o.type == "function_call"] == ["get_time"]

        events = [e async for e in await client.responses.create(**base, tool_choice="required", extra_body={"seed": 0}, stream=True)]
        added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert added and len(done) == len(added)
        for item, d in zip(added, done, strict=True):
            frags = "".join(e.delta for e in events
                            if e.type == "response.function_call_arguments.delta" and e.item_id == item.id)
            assert frags == d.arguments
        assert [(c.name, c.arguments) for c in calls] == [(d.name, d.arguments) for d in done]  # same seed
        assert events[-1].type == "response.completed"
        async with client.responses.stream(**base, tool_choice="required", extra_body={"seed": 0}) as helper:
            seen = [e.type async for e in helper]
            final = await helper.get_final_response()  # the SDK's accumulator rebuilt every item
        assert "response.function_call_arguments.delta" in seen and final.status == "completed"
        assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == \
            [(c.name, c.arguments) for c in calls]

        schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
                  "additionalProperties": False}
        j = await client.responses.create(model=TINY, input="A pet as JSON.", max_output_tokens=60, extra_body={"seed": 2},
                                          text={"format": {"type": "json_schema", "name": "pet", "schema": schema,
                                                           "strict": True}})
        jsonschema.validate(json.loads(j.output_text), schema)


async def test_input_items_list_the_request_input_paged(encoder):
    async with api(encoder) as (_, _fw, client):
        one = await client.responses.create(model=MODEL, input="just text", max_output_tokens=2)
        page = await client.responses.input_items.list(one.id)
        assert [(i.type, i.role, i.content[0].text) for i in page.data] == [("message", "user", "just text")]
        items = [{"role": "system", "content": "Sys."}, {"role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
                 {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": "c1", "output": "5"}]
        tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
        r = await client.responses.create(model=MODEL, input=items, tools=tools, max_output_tokens=2, stream=True)
        rid = [e async for e in r][-1].response.id
        asc = await client.responses.input_items.list(rid, order="asc")
        assert [i.type for i in asc.data] == ["message", "message", "function_call", "function_call_output"]
        assert asc.data[2].call_id == "c1" and asc.data[3].output == "5" and len({i.id for i in asc.data}) == 4
        desc = await client.responses.input_items.list(rid)  # OpenAI's default order is newest first
        assert [i.id for i in desc.data] == [i.id for i in reversed(asc.data)]
        first = await client.responses.input_items.list(rid, order="asc", limit=3)
        assert first.has_more and [i.id for i in first.data] == [i.id for i in asc.data[:3]]
        rest = await client.responses.input_items.list(rid, order="asc", limit=3, after=first.data[-1].id)
        assert not rest.has_more and [i.id for i in rest.data] == [asc.data[3].id]
        every = [i.id async for i in client.responses.input_items.list(rid, order="asc", limit=1)]  # SDK paging
        assert every == [i.id for i in asc.data]
        for kw, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "nope"}, "after"),
                          ({"include": ["message.output_text.logprobs"]}, "include[0]")):
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.input_items.list(rid, **kw)
            assert e.value.body["param"] == param, e.value.body
        private = await client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list(private.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.cancel("resp_unknown")
        assert (await client.responses.input_items.list(one.id)).data[0].content[0].text == "just text"
