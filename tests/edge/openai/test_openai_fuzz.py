"""Fuzzed OpenAI request bodies: the server never crashes, never answers 5xx, and every refused
body gets a 400 in OpenAI's error shape (404 only for a well-formed request naming another model).

The edge runs on its own event loop in a thread (every admitted request fails at the fake worker
with ``invalid_request`` at once); hypothesis drives a synchronous HTTP client."""

from __future__ import annotations

import asyncio
import http.client
import threading
from collections.abc import Iterator

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.edge.conftest import MODEL, running_edge

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "n", "stream",
          "stream_options", "include_usage", "user", "echo", "role", "content", "type", "text", "response_format",
          "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "repetition_penalty", "min_tokens"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
    st.sampled_from([MODEL, "user", "system", "text", "", "\x00", "🙂" * 10, "1e309"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8),
                                                                      inner, max_size=4)), max_leaves=12)
VALID = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 4}
mutated = st.builds(lambda k, v: {**VALID, k: v}, st.sampled_from([f for f in FIELDS if f != "model"]), values)
bodies = st.one_of(
    st.binary(max_size=200),
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), values, max_size=7).map(orjson.dumps),
    mutated.map(orjson.dumps),
    st.just(b'{"model":"tiny","prompt":"hi","max_tokens":1e400}'),
    st.just(b'{"model":"tiny","prompt":"hi","max_tokens":123456789012345678901234567890}'),
    st.just(b'{"model":"tiny","prompt":"\\ud800"}'),
    st.just(b'{"model":"tiny","prompt":[99999999999]}'),
    st.just(b'{"model":"tiny","prompt":"hi","logit_bias":{"99999999":5}}'),
    st.just(b'{"model":"tiny","prompt":"hi","logit_bias":{"-1":5}}'),
)


@pytest.fixture(scope="module")
def port(encoder) -> Iterator[int]:
    ready = threading.Event()
    box: dict = {}

    async def main() -> None:
        box["loop"] = asyncio.get_running_loop()
        box["stop"] = asyncio.Event()
        async with running_edge(encoder, worker_kw={"error": "invalid_request"}, max_frame_bytes=64 * 1024,
                                keys=None, openai_port=0) as (edge, _):
            box["port"] = edge.openai_port
            ready.set()
            await box["stop"].wait()

    t = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    t.start()
    assert ready.wait(60), "edge did not start"
    yield box["port"]
    box["loop"].call_soon_threadsafe(box["stop"].set)
    t.join(30)


def post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, chat=st.booleans())
def test_fuzzed_bodies_get_a_400(port: int, body: bytes, chat: bool) -> None:
    status, raw = post(port, "/v1/chat/completions" if chat else "/v1/completions", body)
    if status == 200:  # a valid streaming request: the worker's error arrives as an event, then [DONE]
        events = [e for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and orjson.loads(events[-2][6:])["error"]["type"], raw
        return
    err = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if status == 404:
        assert err["code"] == "model_not_found" and orjson.loads(body)["model"] != MODEL
    else:
        assert status == 400 and err["type"] == "invalid_request_error", (status, err)


def test_server_still_serves_after_fuzz(port: int) -> None:
    status, raw = post(port, "/v1/completions", orjson.dumps({**VALID, "messages": None}))
    assert status == 400 and orjson.loads(raw)["error"]["message"] == "fake error"  # from the worker


NEW_FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "tools", "tool_choice", "text",
              "format", "stream", "store", "previous_response_id", "parallel_tool_calls", "role", "content", "type",
              "call_id", "name", "arguments", "output", "encoding_format", "dimensions", "prompt", "messages",
              "tokens", "add_generation_prompt", "add_special_tokens", "return_token_strs"]
NEW_VALID = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "prompt": "hi", "tokens": [1, 2]}
new_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(NEW_FIELDS) | st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
new_bodies = st.one_of(
    st.binary(max_size=100),
    st.dictionaries(st.sampled_from(NEW_FIELDS), new_values, max_size=6).map(orjson.dumps),
    st.builds(lambda k, v: {**NEW_VALID, k: v}, st.sampled_from(NEW_FIELDS[1:]), new_values).map(orjson.dumps),
)
ROUTES = ["/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize"]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=new_bodies, path=st.sampled_from(ROUTES))
def test_fuzzed_bodies_on_the_new_routes(port: int, body: bytes, path: str) -> None:
    """Responses, embeddings, tokenize: never a 5xx; a 200 is a well-formed answer (a streamed
    response whose worker failed ends with ``response.failed``); else an OpenAI error body."""
    status, raw = post(port, path, body)
    if status == 200:
        if path == "/v1/responses":
            last = [e for e in raw.decode().split("\n\n") if e][-1]
            assert last.startswith("event: response.failed"), raw
        elif path == "/tokenize":
            out = orjson.loads(raw)
            assert out["count"] == len(out["tokens"]), out
        else:
            assert path == "/detokenize" and isinstance(orjson.loads(raw)["prompt"], str), raw
        return
    err = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if status == 404:
        assert err["code"] in ("model_not_found", "not_found"), err
    else:
        assert status == 400 and err["type"] == "invalid_request_error", (status, err)
