"""``/v1/completions`` with a batch of prompts (strings and token-id arrays), ``echo`` and the
refused ``suffix``, through the official SDK: memory bus, the fake worker (output a pure function
of the prompt's ids, ``expected_text``)."""

from __future__ import annotations

import openai
import pytest

from devtools.fake_worker import expected_text
from tests.edge.conftest import MODEL
from tests.edge.openai.test_openai import api


async def test_batch_of_string_and_id_prompts_numbers_choices_prompt_major(encoder):
    async with api(encoder) as (_, fw, client):
        prompts = ["Once upon", "a time there", "lived"]
        r = await client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=2)
        ids = [tuple(encoder.text_ids(p)) for p in prompts]
        assert [c.index for c in r.choices] == list(range(6))
        assert [c.text for c in r.choices] == [expected_text(ids[i // 2], 4) for i in range(6)]
        assert r.usage.prompt_tokens == sum(len(x) for x in ids)  # each prompt counted once
        assert r.usage.completion_tokens == 6 * 4
        assert len(fw.seen) >= 6

        by_ids = await client.completions.create(model=MODEL, prompt=[[5, 6, 7], [9, 10]], max_tokens=3)
        assert [c.text for c in by_ids.choices] == [expected_text((5, 6, 7), 3), expected_text((9, 10), 3)]
        assert by_ids.usage.prompt_tokens == 5

        streamed = ["", "", ""]
        finishes = [None, None, None]
        usage = None
        async for chunk in await client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, stream=True,
                                                           stream_options={"include_usage": True}):
            for c in chunk.choices:
                streamed[c.index] += c.text
                finishes[c.index] = c.finish_reason or finishes[c.index]
            usage = chunk.usage or usage
        assert streamed == [expected_text(x, 4) for x in ids]
        assert finishes == ["length"] * 3 and usage is not None and usage.prompt_tokens == sum(len(x) for x in ids)


async def test_echo_puts_the_prompt_first_streamed_and_not(encoder):
    async with api(encoder) as (_, _fw, client):
        want = expected_text(tuple(encoder.text_ids("Once upon")), 5)
        r = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, echo=True)
        assert r.choices[0].text == "Once upon" + want
        chunks = [c async for c in await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5,
                                                                     echo=True, stream=True)]
        assert chunks[0].choices[0].text == "Once upon"
        assert "".join(c.choices[0].text for c in chunks) == "Once upon" + want
        ids = await client.completions.create(model=MODEL, prompt=[[5, 6, 7]], max_tokens=2, echo=True)
        assert ids.choices[0].text == encoder.tokenizer.decode([5, 6, 7]) + expected_text((5, 6, 7), 2)
        batch = await client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=2, echo=True)
        assert [c.text[:3] for c in batch.choices] == ["a b", "c d"]


@pytest.mark.parametrize(("kw", "param"), [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": ["ok", ""]}, "prompt[1]"),
    ({"prompt": ["ok", 5]}, "prompt"),
    ({"prompt": [[1, 2], [-1]]}, "prompt[1]"),
    ({"prompt": ["x"] * 65}, "prompt"),
    ({"prompt": ["x"] * 33, "n": 2}, "prompt"),
    ({"prompt": []}, "prompt"),
])
async def test_bad_batches_are_400s_naming_the_field(encoder, kw, param):
    async with api(encoder) as (_, _fw, client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=MODEL, max_tokens=2, **kw)
        assert e.value.body["param"] == param, e.value.body
        if param == "suffix":
            assert "insertion" in e.value.body["message"]
        r = await client.completions.create(model=MODEL, prompt="still serving", max_tokens=1)
        assert r.usage.completion_tokens == 1
