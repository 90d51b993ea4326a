"""``/v1/embeddings`` through the official SDK: a real worker on the tiny model (vectors checked
against transformers' own final states, last-token and mean pooled), and bad input as 400s naming
the field."""

from __future__ import annotations

import base64
import struct

import openai
import pytest
import torch

from edge.request import PromptEncoder
from tests.edge.conftest import MODEL
from tests.edge.openai.test_openai import api
from tests.engine_workers.engine.test_embeddings import reference
from tests.engine_workers.engine.test_guided import MODEL as TINY
from tests.engine_workers.engine.test_guided import platform, sdk


async def test_embeddings_match_the_model_and_formats_agree(tiny_model_dir: str) -> None:
    enc = PromptEncoder.from_path(tiny_model_dir)
    async with platform(tiny_model_dir) as (edge, _), sdk(edge) as client:
        texts = ["a short one", "and a somewhat longer sentence to embed"]
        r = await client.embeddings.create(model=TINY, input=texts)
        assert [d.index for d in r.data] == [0, 1] and r.model == TINY
        ids = [enc.text_ids(t) for t in texts]
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(x) for x in ids)
        for d, x in zip(r.data, ids, strict=True):
            vec = torch.tensor(d.embedding)
            assert torch.allclose(vec, reference(tiny_model_dir, x), atol=1e-4)
            assert abs(float(vec.norm()) - 1.0) < 1e-5
        by_ids = await client.embeddings.create(model=TINY, input=[ids[0]])
        assert torch.allclose(torch.tensor(by_ids.data[0].embedding), torch.tensor(r.data[0].embedding), atol=1e-5)
        raw = await client.embeddings.with_raw_response.create(model=TINY, input=texts[0], encoding_format="base64")
        b64 = raw.http_response.json()["data"][0]["embedding"]
        packed = base64.b64decode(b64)
        floats = struct.unpack(f"<{len(packed) // 4}f", packed)
        assert torch.allclose(torch.tensor(floats), torch.tensor(r.data[0].embedding), atol=1e-6)
        chat = await client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3)
        assert chat.usage.completion_tokens == 3  # the worker serves generation alongside


async def test_mean_pooling_by_flag_and_by_request_over_the_real_edge(tiny_model_dir: str) -> None:
    """``--embedding-pooling mean`` (EdgeConfig.embedding_pooling) through the SDK: the mean of every
    prompt row's final state, normalised, as transformers computes it, for a prompt longer than the
    worker's prefill chunk (16 tokens per step); the same prompt again (its blocks now cached) gives
    the same vector; a request's extension field ``pooling`` picks the other pooling."""
    enc = PromptEncoder.from_path(tiny_model_dir)
    text = "a sentence long enough to be prefilled in several chunks of sixteen tokens each, at least three"
    ids = enc.text_ids(text)
    assert len(ids) > 32
    async with platform(tiny_model_dir, engine_kw={"long_prefill_token_threshold": 16},
                        edge_kw={"embedding_pooling": "mean"}) as (edge, _), sdk(edge) as client:
        first = await client.embeddings.create(model=TINY, input=text)
        vec = torch.tensor(first.data[0].embedding)
        assert torch.allclose(vec, reference(tiny_model_dir, ids, "mean"), atol=1e-4)
        assert abs(float(vec.norm()) - 1.0) < 1e-5
        again = await client.embeddings.create(model=TINY, input=[text, text[:20]])
        assert torch.allclose(torch.tensor(again.data[0].embedding), vec, atol=1e-5)
        last = await client.embeddings.create(model=TINY, input=text, extra_body={"pooling": "last"})
        assert torch.allclose(torch.tensor(last.data[0].embedding), reference(tiny_model_dir, ids), atol=1e-4)
        with pytest.raises(openai.BadRequestError) as e:
            await client.embeddings.create(model=TINY, input=text, extra_body={"pooling": "cls"})
        assert e.value.body["param"] == "pooling"
        mean = await client.embeddings.create(model=TINY, input=text)  # still serving
        assert torch.allclose(torch.tensor(mean.data[0].embedding), vec, atol=1e-5)


@pytest.mark.parametrize(("kw", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", 3]}, "input[1]"),
    ({"input": [[1, -2]]}, "input[0]"),
    ({"input": ["x"] * 257}, "input"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": ["ok", [1, 2]]}, "input"),
    ({"input": [[1], [10**6]]}, "input[1]"),
    ({"input": "x", "extra_body": {"pooling": "max"}}, "pooling"),
])
async def test_bad_input_is_a_400_naming_the_field(encoder, kw, param):
    async with api(encoder) as (_, _fw, client):
        with pytest.raises(openai.BadRequestError) as e:
            await client.embeddings.create(model=MODEL, **kw)
        assert e.value.body["param"] == param, e.value.body
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="text-embedding-3-small", input="x")


def test_the_pooling_flag_its_env_twin_and_the_config_check(monkeypatch) -> None:
    import argparse

    from edge.config import ConfigError, EdgeConfig
    from lockgate.serve import register

    def parsed(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        return parser.parse_args(["serve", *argv])

    assert parsed().embedding_pooling == "last"
    assert parsed("--embedding-pooling", "mean").embedding_pooling == "mean"
    monkeypatch.setenv("LOCKGATE_EMBEDDING_POOLING", "mean")
    assert parsed().embedding_pooling == "mean"
    with pytest.raises(SystemExit):
        parsed("--embedding-pooling", "max")
    with pytest.raises(ConfigError, match="embedding_pooling"):
        EdgeConfig(model="m", embedding_pooling="max")
