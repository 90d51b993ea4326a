"""``n`` > 1 through the OpenAI SDK: n choices from one request, each its own seeded request on the
bus (seeds seed, seed + 1, ...): reproducible, different, streamed and non-streamed alike, usage
counting the prompt once (real worker on the tiny model, memory bus)."""

from __future__ import annotations

import openai
import pytest

from tests.engine_workers.engine.test_guided import MODEL, platform, sdk

MSGS = [{"role": "user", "content": "Tell me a story about a fox."}]


async def test_n_choices_are_reproducible_different_and_stream_alike(tiny_model_dir: str) -> None:
    async with platform(tiny_model_dir) as (edge, sent):
        async with sdk(edge) as client:
            kw = dict(model=MODEL, messages=MSGS, max_tokens=12, temperature=1.0, seed=1234, n=3)
            first = await client.chat.completions.create(**kw)
            again = await client.chat.completions.create(**kw)
            texts = [c.message.content for c in first.choices]
            assert [c.index for c in first.choices] == [0, 1, 2]
            assert texts == [c.message.content for c in again.choices]  # same seed, same three answers
            assert len(set(texts)) == 3  # three different answers
            assert first.model_extra["seed"] == 1234
            one = await client.chat.completions.create(**{**kw, "n": 1, "seed": 1235})
            assert one.choices[0].message.content == texts[1]  # choice i is the request with seed + i
            u = first.usage
            assert u.completion_tokens == 3 * 12 and u.total_tokens == u.prompt_tokens + 36
            streamed = ["", "", ""]
            usage = None
            async for chunk in await client.chat.completions.create(**kw, stream=True,
                                                                     stream_options={"include_usage": True}):
                for c in chunk.choices:
                    streamed[c.index] += c.delta.content or ""
                usage = chunk.usage or usage
            assert streamed == texts and usage is not None and usage.completion_tokens == 36
            c = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, seed=9,
                                                temperature=1.0)
            assert [x.index for x in c.choices] == [0, 1] and c.usage.completion_tokens == 12
            for bad in (0, 9):
                with pytest.raises(openai.BadRequestError) as exc:
                    await client.chat.completions.create(**{**kw, "n": bad})
                assert exc.value.body["param"] == "n"
