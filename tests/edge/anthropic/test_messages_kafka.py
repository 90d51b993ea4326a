"""The Messages API end to end over real Kafka: the ``anthropic`` SDK -> edge -> Kafka -> a real
worker (tiny model) -> edge -> SDK. Checks what the fake worker cannot: exact usage with the prefix
cache, streamed and non-streamed agreement at temperature 0, and a real stop sequence."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import anthropic
import pytest

from bus import ChatMessage
from tests.edge.openai.test_openai_kafka import platform
from tests.engine_workers.worker.test_worker_memory import MODEL, make_engine, tiny_dir  # noqa: F401 - pytest fixtures, used by name

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about Kafka topics."}]


async def test_anthropic_sdk_against_a_real_worker_over_kafka(kafka_bootstrap: str, tiny_dir: Path) -> None:
    async with contextlib.AsyncExitStack() as stack, \
            platform(kafka_bootstrap, tiny_dir) as (edge, _, _, _, encoder):
        client = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{edge.openai_port}", api_key="dev",
                                          max_retries=0, timeout=60)
        await stack.enter_async_context(client)
        n_prompt = len(encoder.chat_ids([ChatMessage(m["role"], m["content"]) for m in MESSAGES]))
        assert (await client.messages.count_tokens(model=MODEL, messages=MESSAGES)).input_tokens == n_prompt

        greedy: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24,
                                  "extra_body": {"temperature": 0}}
        m = await client.messages.create(**greedy)
        text = m.content[0].text  # type: ignore[union-attr]
        assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n_prompt
        assert m.stop_reason in ("max_tokens", "end_turn")
        assert (m.usage.output_tokens == 24) == (m.stop_reason == "max_tokens")
        async with client.messages.stream(**greedy) as s:
            streamed = "".join([t async for t in s.text_stream])
            final = await s.get_final_message()
        assert streamed == text and final.stop_reason == m.stop_reason
        assert final.usage.output_tokens == m.usage.output_tokens
        # the second run of one prompt is served from the prefix cache, and says so
        assert (final.usage.cache_read_input_tokens or 0) > 0
        assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == n_prompt

        # a stop sequence: the text ends before it, stop_reason names it
        stop = text[len(text) // 2:len(text) // 2 + 3]
        if stop.strip() and len(text) > 6:
            s2 = await client.messages.create(**greedy, stop_sequences=[stop])
            assert s2.stop_reason == "stop_sequence" and s2.stop_sequence == stop
            assert s2.content[0].text == text[:text.index(stop)]  # type: ignore[union-attr]
