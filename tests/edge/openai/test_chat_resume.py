"""Resumable chat-completion streams across two edges on one bus (memory bus, fake worker): a
stream whose client drops mid-way is resumed on the other edge with ``Last-Event-ID``, and the
bytes are those the undisturbed stream sends from there; another key and an unknown id get a 404;
a plain stream is neither numbered nor resumable."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import orjson

from bus import MemoryBus
from devtools.fake_worker import FakeWorker, expected_text
from edge.config import EdgeConfig
from edge.openai.resume import RESUME_HEADER
from edge.server import Edge
from tests.edge.conftest import KEY, KEY_P0, MODEL, keys, wait_for
from tests.edge.openai.test_openai import chat_ids

MESSAGES = [{"role": "user", "content": "hello there"}]
TOKENS = 40


@contextlib.asynccontextmanager
async def two_edges(encoder) -> AsyncIterator[tuple[FakeWorker, list[str], aiohttp.ClientSession]]:
    async with MemoryBus("memory://") as bus, FakeWorker(bus, MODEL, step_s=0.02) as fw, \
            contextlib.AsyncExitStack() as stack:
        urls = []
        for name in ("a", "b"):
            edge = await stack.enter_async_context(Edge(EdgeConfig(
                model=MODEL, port=0, openai_port=0, keys=keys(), ping_interval_s=None, edge_id=f"edge-{name}"),
                bus, encoder))
            await wait_for(lambda e=edge: e.readiness()[0])
            urls.append(f"http://127.0.0.1:{edge.openai_port}/v1/chat/completions")
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)))
        yield fw, urls, http


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def body(**extra) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": TOKENS, "stream": True, "seed": 7,
            "stream_options": {"include_usage": True}, **extra}


def events(raw: bytes) -> list[bytes]:
    """The SSE events of a stream, each with its separator."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    return [e + b"\n\n" for e in raw[:-2].split(b"\n\n")]


def content(raw: bytes) -> str:
    text = ""
    for e in events(raw):
        data = e.split(b"data: ", 1)[1].strip()
        if data != b"[DONE]":
            for c in orjson.loads(data)["choices"]:
                text += c["delta"].get("content") or ""
    return text


async def test_a_dropped_stream_resumes_on_the_other_edge_byte_for_byte(encoder):
    async with two_edges(encoder) as (fw, (a, b), http):
        want = expected_text(chat_ids(encoder, MESSAGES), TOKENS)
        # an undisturbed resumable stream, and its full replay from the other edge: the same bytes
        async with http.post(a, json=body(resumable=True), headers=auth()) as r:
            assert r.status == 200
            cid = r.headers[RESUME_HEADER]
            whole = await r.read()
        assert content(whole) == want and whole.endswith(b"data: [DONE]\n\n")
        numbered = events(whole)
        assert [e.split(b"\n", 1)[0] for e in numbered] == [b"id: %d" % i for i in range(len(numbered))]
        async with http.get(f"{b}/{cid}", headers=auth()) as r:
            assert r.status == 200 and await r.read() == whole

        # a second stream, cut after a few events: resumed on edge b after the last complete one
        r = await http.post(a, json=body(resumable=True), headers=auth())
        cid = r.headers[RESUME_HEADER]
        assert cid.startswith("chatcmpl-")
        got: list[bytes] = []
        while len(got) < 5:
            got.append(await r.content.readuntil(b"\n\n"))
        r.close()  # the client drops the connection mid-stream
        last = int(got[-1].split(b"\n", 1)[0].removeprefix(b"id: "))
        async with http.get(f"{b}/{cid}", headers={**auth(), "Last-Event-ID": str(last)}) as r:
            assert r.status == 200 and r.headers[RESUME_HEADER] == cid
            rest = await r.read()
        resumed = b"".join(got) + rest
        assert content(resumed) == want
        rid = cid.removeprefix("chatcmpl-")
        assert not [x for x in fw.cancels if x.request_id == rid]  # it ran on without its client
        async with http.get(f"{b}/{cid}", headers=auth()) as r:  # the undisturbed stream's bytes
            full = await r.read()
        assert resumed == full
        async with http.get(f"{a}/{cid}?starting_after={last}", headers=auth()) as r:  # the query form, edge a
            assert await r.read() == rest
        # the same events as the first stream, less its id and created time
        assert len(events(full)) == len(numbered)

        # only the key that made it may resume it; an unknown id is the same 404
        for url, key in ((f"{b}/{cid}", KEY_P0), (f"{b}/chatcmpl-nope", KEY), (f"{b}/{rid}", KEY)):
            async with http.get(url, headers=auth(key)) as r:
                assert r.status == 404, url
                assert (await r.json())["error"]["code"] == "not_found"
        async with http.get(f"{b}/{cid}", headers={**auth(), "Last-Event-ID": "x"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "Last-Event-ID"


async def test_a_plain_stream_is_not_resumable(encoder):
    async with two_edges(encoder) as (fw, (a, b), http):
        async with http.post(a, json=body(), headers=auth()) as r:
            assert r.status == 200 and RESUME_HEADER not in r.headers
            raw = await r.read()
        assert b"id: " not in raw.replace(b'"id":', b"")  # no event ids: the plain stream's bytes as before
        cid = orjson.loads(events(raw)[0].split(b"data: ", 1)[1])["id"]
        async with http.get(f"{b}/{cid}", headers=auth()) as r:
            assert r.status == 404
        # a plain stream whose client goes away is still cancelled
        r = await http.post(a, json=body(max_tokens=200), headers=auth())
        assert r.status == 200, await r.text()
        await r.content.readuntil(b"\n\n")
        r.close()
        await wait_for(lambda: any(x.reason == "disconnect" for x in fw.cancels))


async def test_resumable_needs_one_streamed_choice(encoder):
    async with two_edges(encoder) as (_, (a, _b), http):
        for extra in ({"stream": False}, {"n": 2}, {"resumable": "yes"}):
            req = {**body(resumable=True), **extra}
            del req["stream_options"]  # refused on its own without stream
            async with http.post(a, json=req, headers=auth()) as r:
                assert r.status == 400, extra
                assert (await r.json())["error"]["param"] == "resumable"
