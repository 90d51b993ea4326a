"""The Messages API against a real worker on the tiny model (memory bus): what the fake worker
cannot show. A forced tool's input validates against its ``input_schema`` (the grammar chat uses),
``output_config.format`` gives schema-valid JSON, and the streamed and non-streamed answers of one
seed agree."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema

from tests.engine_workers.engine.test_guided import MODEL, platform

ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100},
                                        "b": {"type": "integer", "minimum": -100, "maximum": 100}},
       "required": ["a", "b"]}
PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
       "required": ["name", "legs"], "additionalProperties": False}
ASK: list[Any] = [{"role": "user", "content": "What is 2 + 3?"}]


def client(edge) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{edge.openai_port}", api_key="dev",
                                    max_retries=0, timeout=120)


async def test_forced_tool_and_output_format_against_a_real_worker(tiny_model_dir: str) -> None:
    async with platform(tiny_model_dir) as (edge, _), client(edge) as c:
        tools: list[Any] = [{"name": "add", "description": "Add two integers", "input_schema": ADD}]
        for seed in range(2):
            m = await c.messages.create(model=MODEL, max_tokens=150, messages=ASK, tools=tools,
                                        tool_choice={"type": "tool", "name": "add"},
                                        extra_body={"temperature": 1.0, "seed": seed})
            calls = [b for b in m.content if b.type == "tool_use"]
            assert m.stop_reason == "tool_use" and len(calls) == 1 and calls[0].name == "add"
            jsonschema.validate(calls[0].input, ADD)
        async with c.messages.stream(model=MODEL, max_tokens=150, messages=ASK, tools=tools,
                                     tool_choice={"type": "any"}) as s:
            final = await s.get_final_message()
        streamed = [b for b in final.content if b.type == "tool_use"]
        assert final.stop_reason == "tool_use" and len(streamed) == 1
        jsonschema.validate(streamed[0].input, ADD)

        fmt: Any = {"format": {"type": "json_schema", "schema": PET}}
        m = await c.messages.create(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "A pet?"}],
                                    output_config=fmt)
        assert m.stop_reason == "end_turn"
        jsonschema.validate(json.loads(m.content[0].text), PET)  # type: ignore[union-attr]

        # one seed, streamed and not: the same text (greedy-free sampling, reproducible by seed)
        kw: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "messages": ASK, "extra_body": {"seed": 7}}
        plain = await c.messages.create(**kw)
        async with c.messages.stream(**kw) as s:
            text = "".join([t async for t in s.text_stream])
        assert text == plain.content[0].text  # type: ignore[union-attr]
