"""Responses that survive the edge (issue #51), over real Kafka: two ``lockgate edge`` processes and a
worker (tiny model). Edge A is killed (-9) mid-stream; the official SDK's
``responses.retrieve(id, stream=True, starting_after=N)`` on another edge, a warm one and one
started only after the kill (cold), completes the response with exactly the events of an
undisturbed run (ids and creation times aside: a different response; chunk borders aside: a
worker's step timing cuts them), greedy and seeded; two edges replaying one response agree byte for
byte. Also:
a dropped connection without an edge death, ``previous_response_id`` on another edge, ``GET``
from any edge, and another key's 404. The same kill takes a resumable WebSocket stream down with
it; a ``resume`` frame on the other edges completes it with the undisturbed run's tokens."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from websockets.asyncio.client import connect as ws_open

from bus import connect
from tests.edge.fleet import EdgeFleet
from tests.engine_workers.worker.test_worker_kafka import kafka_url, new_layout, spawn_worker, wait_ready
from tests.engine_workers.worker.test_worker_memory import MODEL, tiny_dir  # noqa: F401 - a fixture

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(420)]

PROMPT = "Tell me about Kafka topics."
MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.9, "extra_body": {"seed": 4242}}}
TOKENS = 400
KILL_AFTER = 2  # text deltas the client has read from edge A when A is killed


def normalized(events: list[Any], rid: str) -> list[Any]:
    """The events as JSON values, the response's own id, creation time and prefix-cache hits taken
    out (a reference run is another response: its id, item ids derived from it, and clock differ,
    and the later run of one prompt finds it cached)."""
    hexpart = rid.removeprefix("resp_")

    def norm(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items() if k not in ("created_at", "cached_tokens")}
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, str):
            return v.replace(hexpart, "<id>")
        return v
    return [norm(e.model_dump(mode="json")) for e in events]


def merged(events: list[Any]) -> list[Any]:
    """:func:`normalized`, each run of text deltas merged into one: how a worker cuts its output into
    chunks depends on its step timing, so two runs agree on the text, not on the chunk borders."""
    out: list[Any] = []
    for e in events:
        if e.get("type") == "response.output_text.delta" and out and out[-1].get("type") == e["type"]:
            out[-1] = {**out[-1], "delta": out[-1]["delta"] + e["delta"]}
        else:
            out.append({k: v for k, v in e.items() if k != "sequence_number"})
    return out


def text_of(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def sdk(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


WS_MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.9, "seed": 4242}}


async def ws_read(c: Any, upto: int | None = None) -> tuple[str, list[int], int]:
    """A resumable WebSocket stream's (text, token ids, next index) up to ``upto`` tokens, or its end."""
    text, ids, nxt = "", [], 0
    while upto is None or nxt < upto:
        f = orjson.loads(await asyncio.wait_for(c.recv(), 60))
        if f["type"] == "done":
            break
        assert f["type"] == "delta", f
        text, ids, nxt = text + f["text"], ids + f["token_ids"], f["seq"] + len(f["token_ids"])
    return text, ids, nxt


def ws_connect(fleet: EdgeFleet, edge: str, key: str) -> Any:
    return ws_open(f"ws://127.0.0.1:{fleet.ws_ports[edge]}/ws", additional_headers={"Authorization": f"Bearer {key}"})


async def ws_start(c: Any, cid: str, mode: str) -> str:
    await c.send(orjson.dumps({"type": "generate", "id": cid, "prompt": PROMPT, "max_tokens": TOKENS,
                               "ignore_eos": True, "resumable": True, **WS_MODES[mode]}).decode())
    f = orjson.loads(await asyncio.wait_for(c.recv(), 60))
    assert f["type"] == "accepted", f
    return f["request_id"]


async def ws_resume(fleet: EdgeFleet, edge: str, key: str, rid: str, nxt: int) -> tuple[str, list[int], int]:
    async with ws_connect(fleet, edge, key) as c:
        await c.send(orjson.dumps({"type": "resume", "id": "r", "request_id": rid, "seq": nxt}).decode())
        return await ws_read(c)


async def read_until_deltas(stream: Any, n: int) -> list[Any]:
    got: list[Any] = []
    async for e in stream:
        got.append(e)
        if sum(x.type == "response.output_text.delta" for x in got) >= n:
            return got
    raise AssertionError(f"the stream ended after {len(got)} events, before {n} text deltas")


@contextlib.asynccontextmanager
async def worker(bootstrap: str, model_dir: Path, layout, logs: Path):
    """A worker process of its own (the test process runs only clients: its heartbeats never stall)."""
    async with connect(kafka_url(bootstrap)) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL))
    proc = spawn_worker(bootstrap, model_dir, layout, "w1", logs / "w1.log", max_num_seqs=4)
    try:
        await wait_ready(proc)
        yield
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


async def test_a_response_resumes_on_any_edge_after_a_kill(private_kafka, tiny_dir: Path, tmp_path: Path) -> None:
    # a broker of this test's own: the shared one's topics are deleted by other sessions' teardowns
    kafka_bootstrap = private_kafka.bootstrap
    layout = new_layout(2)
    model = tmp_path / MODEL  # the edge serves the folder's name: the worker's model name
    model.symlink_to(tiny_dir)
    fleet = EdgeFleet(kafka_bootstrap, model, layout.namespace, layout.partitions, tmp_path)
    alice, bob = fleet.keys["alice"], fleet.keys["bob"]
    async with worker(kafka_bootstrap, tiny_dir, layout, tmp_path), contextlib.AsyncExitStack() as stack:
        stack.callback(fleet.close)
        await fleet.start("e1", "e2")
        clients: dict[tuple[str, str], openai.AsyncOpenAI] = {}

        async def client(edge: str, key: str = alice) -> openai.AsyncOpenAI:
            if (edge, key) not in clients:
                clients[edge, key] = await stack.enter_async_context(sdk(fleet.url(edge), key))
            return clients[edge, key]

        victim, cold_names = "e1", iter(("e3", "e4"))
        for mode, kw in MODES.items():
            base = {"model": MODEL, "input": PROMPT, "max_output_tokens": TOKENS, **kw}
            base["extra_body"] = {**base.get("extra_body", {}), "ignore_eos": True}
            # the undisturbed run (edge e2 stays up throughout)
            ref = [e async for e in await (await client("e2")).responses.create(**base, stream=True, background=True)]
            ref_id = ref[0].response.id
            assert ref[-1].type == "response.incomplete" and ref[-1].response.usage.output_tokens == TOKENS
            want = merged(normalized(ref, ref_id))

            async with ws_connect(fleet, "e2", alice) as c:  # the WebSocket's undisturbed run
                await ws_start(c, "ref", mode)
                ws_ref = await ws_read(c)
            assert len(ws_ref[1]) == TOKENS

            # edge A (the victim) is killed with its clients mid-stream: a Responses and a WebSocket one
            ws_victim = await ws_connect(fleet, victim, alice).__aenter__()
            ws_rid = await ws_start(ws_victim, "v", mode)
            stream = await (await client(victim)).responses.create(**base, stream=True, background=True)
            before = await read_until_deltas(stream, KILL_AFTER)
            rid, last = before[0].response.id, before[-1].sequence_number
            ws_before = await ws_read(ws_victim, 1)
            fleet.kill(victim)
            with contextlib.suppress(Exception):
                await ws_victim.__aexit__(None, None, None)
            ws_after = await ws_resume(fleet, "e2", alice, ws_rid, ws_before[2])
            assert ws_before[1] + ws_after[1] == ws_ref[1] and ws_before[0] + ws_after[0] == ws_ref[0], mode
            assert ws_after[2] == TOKENS
            with contextlib.suppress(Exception):
                await stream.close()
            clients.pop((victim, alice), None)

            # resumed on the warm edge, from where the client was
            after = [e async for e in await (await client("e2")).responses.retrieve(rid, stream=True,
                                                                                   starting_after=last)]
            assert [e.sequence_number for e in after] == list(range(last + 1, last + 1 + len(after)))
            assert merged(normalized(before + after, rid)) == want, mode
            assert text_of(before + after) == text_of(ref)

            # on an edge started after the kill (cold), from another position: the same events
            cold = next(cold_names)
            await fleet.start(cold)
            mid = last // 2
            again = [e async for e in await (await client(cold)).responses.retrieve(rid, stream=True,
                                                                                    starting_after=mid)]
            # the same response read on two edges: the same events, byte for byte
            assert normalized(before[:mid + 1] + again, rid) == normalized(before + after, rid), mode
            got = await (await client(cold)).responses.retrieve(rid)
            assert got.output_text == text_of(ref) and got.status == "incomplete"

            # the WebSocket stream on the cold edge too, from its start
            assert (await ws_resume(fleet, cold, alice, ws_rid, 0))[1] == ws_ref[1]
            # another key: the 404 of an unknown id, for every call
            other = await client(cold, bob)
            for call in (other.responses.retrieve, other.responses.cancel, other.responses.delete):
                with pytest.raises(openai.NotFoundError):
                    await call(rid)

            # a follow-up turn on another edge than the one that made the previous response
            first = await (await client("e2")).responses.create(model=MODEL, input="hi", max_output_tokens=4)
            follow = await (await client(cold)).responses.create(model=MODEL, input="and then?",
                                                                  previous_response_id=first.id, max_output_tokens=3)
            assert follow.previous_response_id == first.id and follow.usage.output_tokens >= 1
            assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
            victim = cold  # the next round kills the edge that started cold in this one

        # a dropped connection without an edge death: the background response runs on, and the
        # same edge resumes it
        base = {"model": MODEL, "input": PROMPT, "max_output_tokens": TOKENS, "temperature": 0.0,
                "extra_body": {"ignore_eos": True}}
        c2 = await client("e2")
        stream = await c2.responses.create(**base, stream=True, background=True)
        before = await read_until_deltas(stream, KILL_AFTER)
        await stream.close()  # the TCP connection goes; edge e2 stays
        rid, last = before[0].response.id, before[-1].sequence_number
        after = [e async for e in await c2.responses.retrieve(rid, stream=True, starting_after=last)]
        ref = [e async for e in await c2.responses.create(**base, stream=True, background=True)]
        assert merged(normalized(before + after, rid)) == merged(normalized(ref, ref[0].response.id))
