"""Hostile input at the edge (issue #38): each case gets a clear 4xx naming what was wrong, and
the server stays healthy (a normal request succeeds right after). Real API keys, a memory bus and
the fake worker; every case bounded in size and time (the whole file runs in a few seconds)."""

from __future__ import annotations

import asyncio
import io
import json
import time

import aiohttp
import orjson
import pytest

from edge.config import KeyEntry, hash_key
from tests.edge.conftest import KEY, MODEL, client, collect, recv, running_edge, send
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)
KEY_B = "lg-test-key-other"
CONTEXT = 1024  # the tiny tokenizer's config.json (tests/edge/conftest.py)


def key_file(**limits) -> dict[str, KeyEntry]:
    a = KeyEntry(hash_key(KEY), "acme", 1, **limits)
    b = KeyEntry(hash_key(KEY_B), "rival", 1, **limits)
    return {a.key_hash: a, b.key_hash: b}


def nested(depth: int) -> bytes:
    return b'{"model":"tiny","prompt":"hi","metadata":' + b"[" * depth + b"]" * depth + b"}"


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}).encode()


# (name, path, raw body, expected status, words the error message must contain)
CASES = [
    ("oversized body", "/v1/chat/completions", b'{"model":"tiny","prompt":"' + b"a" * (1100 * 1024) + b'"}', 400,
     ["body", "larger than 1048576 bytes"]),
    ("deeply nested body", "/v1/completions", nested(5000), 400, ["json"]),
    ("invalid utf-8", "/v1/completions", b'{"model":"tiny","prompt":"\xff\xfe"}', 400, ["utf-8"]),
    ("NaN literal", "/v1/chat/completions", chat()[:-1] + b',"temperature":NaN}', 400, ["json"]),
    ("temperature negative", "/v1/chat/completions", chat(temperature=-1), 400, ["temperature"]),
    ("temperature 1e400 (inf)", "/v1/chat/completions", chat()[:-1] + b',"temperature":1e400}', 400, ["json", "infinity"]),
    ("top_p out of range", "/v1/chat/completions", chat(top_p=1.5), 400, ["top_p"]),
    ("top_k negative", "/v1/chat/completions", chat(top_k=-5), 400, ["top_k"]),
    ("n = 1000", "/v1/chat/completions", chat(n=1000), 400, ["n"]),
    ("5,000 stop strings", "/v1/chat/completions", chat(stop=[f"s{i}" for i in range(5000)]), 400, ["stop"]),
    ("2,000 tools", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
                 for i in range(2000)]), 400, ["tools"]),
    ("deep schema", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": deep_schema(200)}}), 400,
     ["schema", "64 levels"]),
    ("deep guided_json", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                        "guided_json": deep_schema(200)}).encode(), 400,
     ["guided_json", "64 levels"]),
    ("deep tool parameters", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep_schema(200)}}]), 400,
     ["parameters", "64 levels"]),
    ("max_tokens 10^9", "/v1/chat/completions", chat(max_tokens=10**9), 400, ["context length", str(CONTEXT)]),
    ("max_completion_tokens 10^9", "/v1/chat/completions", chat(max_completion_tokens=10**9), 400,
     ["context length", str(CONTEXT)]),
    ("completions max_tokens 10^9", "/v1/completions",
     orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 10**9}), 400, ["context length", str(CONTEXT)]),
]


async def post(http: aiohttp.ClientSession, base: str, path: str, body: bytes, key: str = KEY):
    async with http.post(base + path, data=io.BytesIO(body), headers={"Authorization": f"Bearer {key}",
                                                          "Content-Type": "application/json"}) as r:
        return r.status, await r.read()


async def healthy(http: aiohttp.ClientSession, base: str) -> None:
    """A normal request succeeds (the fake worker streams its tokens)."""
    status, raw = await post(http, base, "/v1/chat/completions", chat(max_tokens=3))
    assert status == 200, raw
    body = orjson.loads(raw)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3, body


async def test_each_hostile_body_gets_a_clear_4xx_and_the_server_stays_healthy(encoder) -> None:
    async with running_edge(encoder, keys=key_file(), openai_port=0) as (edge, _), \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        base = f"http://127.0.0.1:{edge.openai_port}"
        await healthy(http, base)
        failures = []
        for name, path, body, want, words in CASES:
            t0 = time.monotonic()
            status, raw = await post(http, base, path, body)
            took = time.monotonic() - t0
            try:
                msg = orjson.loads(raw)["error"]["message"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                msg = raw[:200].decode(errors="replace")
            if status != want or not all(w.lower() in msg.lower() for w in words) or took > 10:
                failures.append((name, status, msg[:200], round(took, 2)))
            await healthy(http, base)
        assert not failures, "\n".join(map(repr, failures))


async def test_websocket_max_tokens_beyond_the_context_is_refused_naming_it(encoder) -> None:
    async with running_edge(encoder, keys=key_file()) as (edge, _), client(edge) as ws:
        await send(ws, {"type": "generate", "id": "big", "prompt": "hi", "max_tokens": 10**9})
        f = await recv(ws)
        assert f["type"] == "error" and f["id"] == "big", f
        assert "context length" in f["message"] and str(CONTEXT) in f["message"], f
        await send(ws, {"type": "generate", "id": "ok", "prompt": "hi", "max_tokens": 3})
        _, deltas, done = await collect(ws, "ok")
        assert done["type"] == "done" and len(deltas) == 3, done


async def test_cancelling_another_keys_request_fails_and_leaves_it_running(encoder) -> None:
    """Cancel is scoped to the connection that made the request: key B naming key A's request id
    gets an error and A's stream runs to its end."""
    async with running_edge(encoder, keys=key_file(), worker_kw={"step_s": 0.02}) as (edge, _), \
            client(edge, KEY) as a, client(edge, KEY_B) as b:
        await send(a, {"type": "generate", "id": "mine", "prompt": "hi", "max_tokens": 20})
        first = await recv(a)
        while first.get("type") not in ("accepted", "delta"):
            first = await recv(a)
        rid = first["request_id"]
        await send(b, {"type": "cancel", "request_id": rid})
        refused = await recv(b)
        assert refused["type"] == "error" and "no request in flight" in refused["message"], refused
        await send(b, {"type": "cancel", "id": "mine"})
        refused = await recv(b)
        assert refused["type"] == "error", refused
        _, deltas, done = await collect(a, "mine")
        assert done["type"] == "done" and done["finish_reason"] == "length", done


async def test_idle_connections_per_key_are_limited(encoder) -> None:
    """A key holding ``max_connections_per_key`` open WebSockets gets a 429 naming the limit for
    the next; another key still connects, and the first key connects again once one closes."""
    limit = 4
    async with running_edge(encoder, keys=key_file(), max_connections_per_key=limit) as (edge, _):
        held = [await client(edge, KEY).__aenter__() for _ in range(limit)]
        try:
            with pytest.raises(Exception) as refused:
                async with client(edge, KEY):
                    pass
            resp = getattr(refused.value, "response", None)
            assert resp is not None and resp.status_code == 429, refused.value
            assert b"max_connections_per_key" in resp.body and str(limit).encode() in resp.body, resp.body
            async with client(edge, KEY_B) as other:
                await send(other, {"type": "generate", "id": "x", "prompt": "hi", "max_tokens": 2})
                assert (await collect(other, "x"))[2]["type"] == "done"
            await held.pop().close()
            await wait_until(lambda: sum(1 for s in edge.sessions if s.principal.entry.key_hash == hash_key(KEY))
                             < limit, timeout=5, interval=0.01)
            async with client(edge, KEY) as again:
                await send(again, {"type": "generate", "id": "y", "prompt": "hi", "max_tokens": 2})
                assert (await collect(again, "y"))[2]["type"] == "done"
        finally:
            for ws in held:
                await ws.close()


async def test_grammar_compile_time_is_bounded(encoder) -> None:
    """A constraint whose compile outlasts ``grammar_compile_timeout_s`` is a 400 naming the limit,
    answered within the bound (plus slack), and other requests are served meanwhile."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "(a|b)*c{1,50}" * 4}
                                                for i in range(60)}, "required": [f"p{i}" for i in range(60)]}
    async with running_edge(encoder, keys=key_file(), openai_port=0, grammar_compile_timeout_s=0.01) as (edge, _), \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        base = f"http://127.0.0.1:{edge.openai_port}"
        body = chat(response_format={"type": "json_schema", "json_schema": {"name": "slow", "schema": schema}})
        t0 = time.monotonic()
        slow = asyncio.create_task(post(http, base, "/v1/chat/completions", body))
        await healthy(http, base)  # served while the compile runs
        status, raw = await slow
        took = time.monotonic() - t0
        err = orjson.loads(raw)["error"]
        assert status == 400 and "compile" in err["message"] and "grammar_compile_timeout_s" in err["message"], raw
        assert took < 10, took
        await healthy(http, base)
