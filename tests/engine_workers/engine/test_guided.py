"""Structured output (#25): xgrammar masks in the engine (JSON schema, choice, regex, resume), the
wire fields, and end to end through the OpenAI SDK and the WebSocket protocol over the memory bus
with a real worker on the tiny model (the fake worker cannot produce JSON)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import orjson
import pytest
import websockets

from bus import MemoryBus, TopicLayout
from bus import messages as wire
from edge.config import EdgeConfig
from edge.request import PromptEncoder
from edge.server import Edge
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.worker.actor import Worker, WorkerConfig
from lockgate_types import SamplingParams
from tests.waiting import wait_until

MODEL = "tiny"

# Nested objects, arrays (of enums and of objects), enums, integers with ranges, required fields.
# Strings and arrays are bounded so that a random model, sampled at temperature 1, ends them.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            },
            "required": ["id", "tags"],
        },
        "friends": {
            "type": "array", "maxItems": 2,
            "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
                      "required": ["name", "ok"]},
        },
    },
    "required": ["name", "kind", "age", "owner", "friends"],
}
SCHEMA_TEXT = json.dumps(SCHEMA)
REGEX = r"[a-c]{2}-\d{3}"


def valid(text: str, schema: dict[str, Any] = SCHEMA) -> Any:
    obj = json.loads(text)
    jsonschema.validate(obj, schema)
    return obj


@pytest.fixture(scope="module")
def engine(tiny_model_dir: str) -> Engine:
    return Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=8 << 20, max_num_seqs=32))


# -- the engine ---------------------------------------------------------------------------------


def test_json_schema_20_sampled_completions_validate(engine: Engine) -> None:
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=s, guided_json=SCHEMA_TEXT) for s in range(20)]
    out = engine.generate(["Describe a pet as JSON."] * 20, params)
    assert all(o.finish_reason == "stop" for o in out), [o.text for o in out if o.finish_reason != "stop"]
    objs = [valid(o.text) for o in out]
    assert len({json.dumps(o) for o in objs}) > 1  # sampled, not one fixed answer
    assert engine._num_guided == 0  # every guided request released its matcher


def test_choice_regex_and_json_object(engine: Engine) -> None:
    choices = ("yes", "no", "naïve \"quoted\"")
    out = engine.generate(["x"] * 12, [SamplingParams(max_tokens=40, seed=s, guided_choice=choices) for s in range(12)])
    assert all(o.text in choices and o.finish_reason == "stop" for o in out)
    out = engine.generate(["x"] * 8, [SamplingParams(max_tokens=40, seed=s, guided_regex=REGEX) for s in range(8)])
    assert all(re.fullmatch(REGEX, o.text) for o in out), [o.text for o in out]
    out = engine.generate(["x"] * 4, [SamplingParams(max_tokens=200, seed=s, guided_json_object=True) for s in range(4)])
    assert all(isinstance(json.loads(o.text), dict) for o in out)


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(engine: Engine) -> None:
    plain = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in range(3)]
    alone = engine.generate(["hello"] * 3, plain)
    mixed = engine.generate(["hello"] * 6, plain + [SamplingParams(max_tokens=16, seed=s, guided_regex=REGEX)
                                                    for s in range(3)])
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]


def test_resumed_constrained_request_continues_the_same_valid_json(engine: Engine) -> None:
    p = SamplingParams(max_tokens=300, temperature=1.0, seed=7, guided_json=SCHEMA_TEXT)
    (full,) = engine.generate(["Describe a pet."], p)
    valid(full.text)
    for k in (1, 5, len(full.token_ids) // 2):
        prefix = list(full.token_ids[:k])
        engine.add_request("resumed", "Describe a pet.", p, resume_token_ids=prefix)
        rest: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                rest.extend(o.token_ids)
        assert tuple(prefix + rest) == full.token_ids
        valid(engine.tokenizer.decode(prefix + rest, skip_special_tokens=True))
    bad = list(engine.tokenizer("not json", add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match="guided_"):
        engine.add_request("bad-resume", "Describe a pet.", p, resume_token_ids=bad)


def test_bad_constraints_are_value_errors(engine: Engine) -> None:
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(guided_json=SCHEMA_TEXT, guided_regex="a")
    with pytest.raises(ValueError, match="guided_regex"):
        engine.add_request("r1", "x", SamplingParams(guided_regex="a(b"))
    with pytest.raises(ValueError, match="guided_json"):
        engine.add_request("r2", "x", SamplingParams(guided_json='{"type": "objectx"}'))
    assert not engine.has_unfinished()


async def test_async_engine_compiles_off_the_step_thread_and_aborts_while_compiling(engine: Engine) -> None:
    schema = json.dumps({**SCHEMA, "title": "async-only"})  # not compiled yet: the compile is pending
    outs: list = []
    async with AsyncEngine(engine) as ae:
        ae.on_outputs = outs.extend
        fut = ae.submit("a1", "x", SamplingParams(max_tokens=300, seed=1, guided_json=schema))
        ae.abort("a1")
        await asyncio.wrap_future(fut)
        await wait_until(lambda: any(o.request_id == "a1" and o.finished for o in outs), timeout=30)
        assert next(o for o in outs if o.finished).finish_reason == "abort"
        got = [o async for o in ae.generate("a2", "x", SamplingParams(max_tokens=300, seed=2, guided_json=schema))]
        valid("".join(o.text for o in got))
        with pytest.raises(ValueError, match="guided_regex"):
            await ae.add_request("a3", "x", SamplingParams(guided_regex="(("))


def test_wire_fields_validate_and_reach_the_engine_key() -> None:
    with pytest.raises(ValueError, match="cannot be combined"):
        wire.SamplingParams(guided_choice=("a",), guided_json_object=True)
    with pytest.raises(ValueError, match="not valid JSON"):
        wire.SamplingParams(guided_json="{nope")
    with pytest.raises(ValueError, match="at most"):
        wire.SamplingParams(guided_choice=tuple(str(i) for i in range(300)))
    with pytest.raises(ValueError, match="longer than"):
        wire.SamplingParams(guided_regex="a" * 70000)
    p = wire.SamplingParams(guided_choice=["x", "y"])
    req = wire.InferenceRequest("r", MODEL, (1, 2), p, "reply")
    back = wire.decode(wire.encode(req))
    assert isinstance(back, wire.InferenceRequest) and back.sampling == p
    assert back.sampling.guided == ("choice", '["x", "y"]')  # the grammar cache's key, straight off the record


# -- end to end: edge + real worker over the memory bus ------------------------------------------


@contextlib.asynccontextmanager
async def platform(model_dir: str | Path, max_num_seqs: int = 16, kv_cache_mib: int = 16,
                   engine_kw: dict | None = None, edge_kw: dict | None = None) -> AsyncIterator[tuple[Edge, list[str]]]:
    """Edge (WebSocket + OpenAI port) and a real worker on ``model_dir``; yields the edge and the
    topics of everything the edge published. ``engine_kw`` / ``edge_kw``: more EngineConfig / EdgeConfig fields."""
    layout = TopicLayout(namespace="guided", partitions=1)
    encoder = PromptEncoder.from_path(str(model_dir))
    engine = Engine(EngineConfig(model=str(model_dir), kv_cache_bytes=kv_cache_mib << 20, max_num_seqs=max_num_seqs,
                                 **(engine_kw or {})))
    bus = MemoryBus()
    await bus.start()
    sent: list[str] = []
    send = bus.send

    async def spy(topic: str, value: bytes, **kw: Any) -> Any:
        sent.append(topic)
        return await send(topic, value, **kw)

    bus.send = spy  # type: ignore[method-assign]
    try:
        await bus.ensure_topics(layout.model_specs(MODEL))
        async with Worker(WorkerConfig(MODEL, layout=layout), bus, engine), \
                Edge(EdgeConfig(model=MODEL, port=0, openai_port=0, layout=layout, ping_interval_s=None,
                                **(edge_kw or {})),
                     bus, encoder) as edge:
            await wait_until(lambda: edge.readiness()[0], timeout=30)
            yield edge, sent
    finally:
        await bus.stop()


def sdk(edge: Edge, timeout: float = 120) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{edge.openai_port}/v1", api_key="dev", max_retries=0,
                              timeout=timeout)


RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


async def test_openai_sdk_json_schema_choice_regex_and_400(tiny_model_dir: str) -> None:
    async with platform(tiny_model_dir) as (edge, sent), sdk(edge) as client:
        msgs = [{"role": "user", "content": "Describe a pet as JSON."}]
        rs = await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, messages=msgs, temperature=1.0, seed=s, max_tokens=300, response_format=RESPONSE_FORMAT)
            for s in range(20)))
        assert all(r.choices[0].finish_reason == "stop" for r in rs)
        for r in rs:
            valid(r.choices[0].message.content)
        # streamed deltas concatenate to a valid document too
        chunks = await client.chat.completions.create(model=MODEL, messages=msgs, seed=99, max_tokens=300,
                                                      response_format=RESPONSE_FORMAT, stream=True)
        valid("".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]))
        # completions + vLLM's extras
        c = await client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, seed=3,
                                            extra_body={"guided_choice": ["left", "right"]})
        assert c.choices[0].text in ("left", "right")
        c = await client.completions.create(model=MODEL, prompt="Code:", max_tokens=40, seed=4,
                                            extra_body={"guided_regex": REGEX})
        assert re.fullmatch(REGEX, c.choices[0].text)
        r = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, seed=5,
                                                 response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict)
        # a schema or regex xgrammar cannot compile: 400 naming the problem, nothing published
        before = len(sent)
        bad_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
        with pytest.raises(openai.BadRequestError) as e1:
            await client.chat.completions.create(model=MODEL, messages=msgs, response_format=bad_format)
        with pytest.raises(openai.BadRequestError) as e2:
            await client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "a(b"})
        with pytest.raises(openai.BadRequestError) as e3:
            await client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "a", "guided_choice": ["b"]})
        err1, err2 = e1.value.body, e2.value.body
        assert isinstance(err1, dict) and isinstance(err2, dict)
        assert err1["param"] == "response_format" and "objectx" in err1["message"], err1
        assert err2["param"] == "guided_regex" and "parenthesis" in err2["message"], err2
        assert "cannot be combined" in str(e3.value)
        assert len(sent) == before


async def ws_generate(ws: Any, frame: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    await ws.send(orjson.dumps({"type": "generate", **frame}).decode())
    text: list[str] = []
    while True:
        msg = orjson.loads(await asyncio.wait_for(ws.recv(), 60))
        if msg["type"] == "delta":
            text.append(msg["text"])
        elif msg["type"] in ("done", "error"):
            return "".join(text), msg


async def test_websocket_json_schema_and_controls(tiny_model_dir: str) -> None:
    async with platform(tiny_model_dir) as (edge, sent), websockets.connect(f"ws://127.0.0.1:{edge.port}/ws") as ws:
        for s in range(20):
            text, done = await ws_generate(ws, {"id": f"j{s}", "messages": [{"role": "user", "content": "pet?"}],
                                                "max_tokens": 300, "seed": s, "guided_json": SCHEMA})
            assert done["type"] == "done" and done["finish_reason"] == "stop", done
            valid(text)
        text, done = await ws_generate(ws, {"id": "c", "prompt": "x", "guided_choice": ["up", "down"], "seed": 1,
                                            "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                                            "frequency_penalty": 0.5, "logit_bias": {"5": 1.0}})
        assert done["type"] == "done" and text in ("up", "down")
        # seeded: an unseeded draw may open a string the random tiny model never closes in 200 tokens
        text, done = await ws_generate(ws, {"id": "r", "prompt": "x", "response_format": {"type": "json_object"},
                                            "max_tokens": 200, "min_tokens": 1, "seed": 3})
        assert done["type"] == "done" and done["finish_reason"] == "stop", done
        assert isinstance(json.loads(text), dict)
        before = len(sent)
        _, err = await ws_generate(ws, {"id": "bad", "prompt": "x", "guided_regex": "a(b"})
        assert err["type"] == "error" and err["field"] == "guided_regex" and "parenthesis" in err["message"]
        _, err = await ws_generate(ws, {"id": "bad2", "prompt": "x", "guided_choice": "nope"})
        assert err["type"] == "error" and err["field"] == "guided_choice"
        assert len(sent) == before


@pytest.mark.slow
@pytest.mark.timeout(1500)
async def test_default_model_json_schema_through_both_apis(default_model_dir: str) -> None:
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "climate": {"enum": ["cold", "mild", "hot"]}}, "required": ["city", "country", "population", "landmarks", "climate"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    msgs = [{"role": "user", "content": "Describe Paris as JSON."}]
    async with platform(default_model_dir, kv_cache_mib=128) as (edge, _), sdk(edge, timeout=1200) as client:
        rs = await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, messages=msgs, temperature=1.0, seed=s, max_tokens=300, response_format=fmt)  # type: ignore[arg-type]
            for s in range(20)))
        for r in rs:
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            valid(r.choices[0].message.content, schema)
        async with websockets.connect(f"ws://127.0.0.1:{edge.port}/ws") as ws:
            text, done = await ws_generate(ws, {"id": "p", "messages": msgs, "max_tokens": 300, "seed": 1,
                                                "response_format": fmt})
            assert done["finish_reason"] == "stop"
            valid(text, schema)
