"""Bad input on every agent-facing route (issue #34): each case a 4xx whose OpenAI-shaped error
names the field, and the same edge answers a good request right after (memory bus, fake worker).
The routes' own test files hold their main cases; this table adds the ones they lacked."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from tests.edge.conftest import KEY, MODEL, running_edge

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
VOCAB = 512  # the tiny tokenizer's (checked below)
CONTEXT = 1024
USER = [{"role": "user", "content": "x"}]

CASES = [
    # /tokenize, /detokenize
    ("/tokenize", {"prompt": "x", "add_generation_prompt": 3}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "continue_final_message": "no"}, "continue_final_message"),
    ("/tokenize", {"messages": USER, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/detokenize", {"tokens": [[1]]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    # /v1/completions: batches, token ids, echo, suffix
    ("/v1/completions", {"prompt": [[1, 2], [VOCAB]]}, "prompt[1]"),
    ("/v1/completions", {"prompt": [VOCAB + 7]}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", [1, 2]]}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt[0]"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2.5]]}, "prompt[0]"),
    ("/v1/completions", {"prompt": [1] * (CONTEXT + 1)}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 2}, "echo"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "x", "suffix": ""}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    # /v1/embeddings
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": [[]]}, "input[0]"),
    ("/v1/embeddings", {"input": [True]}, "input[0]"),
    ("/v1/embeddings", {"input": {"text": "x"}}, "input"),
    ("/v1/embeddings", {"input": "x " * CONTEXT}, "input"),
    ("/v1/embeddings", {"input": ["ok", "x " * CONTEXT]}, "input[1]"),
    ("/v1/embeddings", {"input": [1] * (CONTEXT + 1)}, "input"),
    ("/v1/embeddings", {"input": [VOCAB]}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": 5}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "pooling": ["mean"]}, "pooling"),
    ("/v1/embeddings", {"input": "x", "user": 5}, "user"),
    # /v1/responses: input items
    ("/v1/responses", {"input": [None]}, "input[0]"),
    ("/v1/responses", {"input": [{"type": "message"}]}, "input[0].role"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ("/v1/responses", {"input": "x", "previous_response_id": 5}, "previous_response_id"),
    ("/v1/responses", {"input": "x", "store": "yes"}, "store"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=[f"{p}:{f}:{i}" for i, (p, _, f) in enumerate(CASES)])
async def test_bad_input_is_a_4xx_naming_the_field(encoder, path: str, body: dict, param: str) -> None:
    assert (len(encoder.tokenizer), encoder.context_len) == (VOCAB, CONTEXT)
    async with running_edge(encoder, openai_port=0) as (edge, _), aiohttp.ClientSession(headers=AUTH) as http:
        root = f"http://127.0.0.1:{edge.openai_port}"
        async with http.post(root + path, data=orjson.dumps({"model": MODEL, **body})) as r:
            err = (await r.json())["error"]
            assert r.status == 400, (r.status, err)
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param and err["message"], err
        if path == "/v1/embeddings":  # in the route's words: its field, never "prompt"
            assert "prompt" not in err["message"] and "output token" not in err["message"], err
        async with http.post(f"{root}/tokenize", data=orjson.dumps({"prompt": "still serving"})) as r:
            assert r.status == 200
        async with http.get(f"{root}/health") as r:
            assert r.status == 200


async def test_probes_refuse_other_methods_and_stay_up(encoder) -> None:
    """``/health``, ``/ready``, ``/metrics``, ``/version`` are GETs: another method is a 405, a query
    string is ignored, and the probes still answer."""
    async with running_edge(encoder, openai_port=0) as (edge, _), aiohttp.ClientSession() as http:
        root = f"http://127.0.0.1:{edge.openai_port}"
        for path in ("/health", "/ready", "/metrics", "/version"):
            async with http.post(root + path, data=b"{}") as r:
                assert r.status == 405, path
            async with http.get(f"{root}{path}?verbose=1&x[]=2") as r:
                assert r.status == 200, path
        for path in ("/v1/embeddings", "/tokenize", "/detokenize"):
            async with http.get(root + path) as r:
                assert r.status == 405, path
        async with http.get(f"{root}/metrics") as r:
            assert r.status == 200 and "lockgate:" in await r.text()
