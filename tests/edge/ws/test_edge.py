"""The edge end to end in-process: memory bus + loopback WebSockets + the fake worker."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bus import Cancel, decode
from devtools.fake_worker import expected_text
from tests.edge.conftest import (
    KEY,
    KEY_P0,
    client,
    collect,
    keys,
    recv,
    running_edge,
    send,
    url,
    wait_for,
)

HELLO = [{"role": "user", "content": "hello there"}]


def gen(cid="a", max_tokens=8, **kw):
    return {"type": "generate", "id": cid, "messages": HELLO, "max_tokens": max_tokens, **kw}


async def http_get(edge, path):
    def get():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{edge.port}{path}", timeout=5) as r:
                return r.status, dict(r.headers), r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read().decode()

    return await asyncio.to_thread(get)


async def test_stream_text_equals_worker_output(encoder):
    async with running_edge(encoder) as (edge, fw):
        async with client(edge) as ws:
            await send(ws, gen("a", 12, token_ids=True))
            acc = await recv(ws)
            assert acc["type"] == "accepted" and acc["id"] == "a" and acc["max_tokens"] == 12
            text, deltas, done = await collect(ws, "a")
            assert done["type"] == "done" and done["finish_reason"] == "length"
            assert done["usage"]["completion_tokens"] == 12 and done["timings"]["ttft"] is not None
            assert text == expected_text(fw.seen[0].prompt_token_ids, 12)
            assert sum(len(d["token_ids"]) for d in deltas) == 12
            seqs = [d["seq"] for d in deltas]
            assert seqs == sorted(seqs) and seqs[0] == 0
            req = fw.seen[0]
            assert req.tenant == "acme" and req.tier == 1 and req.reply_to == edge.reply_topic


async def test_several_requests_in_flight_on_one_connection(encoder):
    async with running_edge(encoder, worker_kw={"step_s": 0.001}) as (edge, fw):
        async with client(edge) as ws:
            for i in range(5):
                await send(ws, gen(f"r{i}", 20 + i, prompt=None) | {"messages": [{"role": "user", "content": f"q{i}"}]})
            texts: dict[str, str] = {}
            done = set()
            while len(done) < 5:
                f = await recv(ws)
                if f["type"] == "delta":
                    texts[f["id"]] = texts.get(f["id"], "") + f["text"]
                elif f["type"] == "done":
                    done.add(f["id"])
            by_rid = {r.request_id: r for r in fw.seen}
            assert len(by_rid) == 5
            for r in fw.seen:
                cid = next(k for k in texts if expected_text(r.prompt_token_ids, r.sampling.max_tokens) == texts[k])
                assert cid


async def test_401_on_missing_or_bad_key(encoder):
    async with running_edge(encoder) as (edge, _):
        for headers in (None, {"Authorization": "Bearer nope"}, {"Authorization": "Basic x"}):
            with pytest.raises(InvalidStatus) as ei:
                async with connect(url(edge), additional_headers=headers):
                    pass
            assert ei.value.response.status_code == 401
        with pytest.raises(InvalidStatus) as ei:
            async with connect(url(edge) + "?api_key=wrong"):
                pass
        assert ei.value.response.status_code == 401
        # the two browser-friendly ways in
        async with connect(url(edge) + f"?api_key={KEY}") as ws:
            await send(ws, gen("q", 2))
            assert (await recv(ws))["type"] == "accepted"
        async with connect(url(edge), subprotocols=["lockgate.v1", f"bearer.{KEY}"]) as ws:
            assert ws.subprotocol == "lockgate.v1"
            await send(ws, gen("s", 2))
            assert (await recv(ws))["type"] == "accepted"
        assert 'reason="unauthorized"' in edge.metrics.render().decode()


async def test_dev_mode_accepts_anyone(encoder):
    async with running_edge(encoder, keys=None) as (edge, fw):
        async with connect(url(edge)) as ws:
            await send(ws, gen("a", 3))
            _, _, done = await collect(ws, "a")
            assert done["type"] == "done" and fw.seen[0].tenant == "dev"


async def test_rate_limited_with_retry_after(encoder):
    async with running_edge(encoder, keys=keys(requests_per_min=2, max_streams=0)) as (edge, _):
        async with client(edge) as ws:
            for cid in ("a", "b"):
                await send(ws, gen(cid, 2))
                await collect(ws, cid)
            await send(ws, gen("c", 2))
            err = await recv(ws)
            assert err["type"] == "error" and err["code"] == "rate_limited" and err["id"] == "c"
            assert err["field"] == "requests_per_min" and 25 < err["retry_after"] <= 30
            await send(ws, {"type": "generate", "id": "d", "prompt": "x", "max_tokens": 2})  # still rate limited,
            assert (await recv(ws))["code"] == "rate_limited"                                # connection usable


async def test_concurrent_stream_limit(encoder):
    async with running_edge(encoder, keys=keys(max_streams=1), worker_kw={"step_s": 0.05}) as (edge, _):
        async with client(edge) as ws, client(edge) as ws2:
            await send(ws, gen("a", 50))
            assert (await recv(ws))["type"] == "accepted"
            await send(ws2, gen("b", 5))
            err = await recv(ws2)
            assert err["code"] == "rate_limited" and err["field"] == "max_streams" and err["retry_after"] > 0
            await send(ws, {"type": "cancel", "id": "a"})
            await collect(ws, "a")
            await send(ws2, gen("c", 2))
            assert (await recv(ws2))["type"] == "accepted"


async def test_tokens_per_min(encoder):
    async with running_edge(encoder, keys=keys(tokens_per_min=100, max_streams=0)) as (edge, _):
        async with client(edge) as ws:
            await send(ws, gen("a", 500))
            err = await recv(ws)
            assert err["code"] == "rate_limited" and err["field"] == "tokens_per_min"


async def test_overloaded_and_503_and_readyz(encoder):
    async with running_edge(encoder, heartbeat_stale_s=0.5, slo_wait_s=(1.0, 2.0, 60.0)) as (edge, fw):
        status, _, body = await http_get(edge, "/readyz")
        assert status == 200 and body.startswith("ready")
        async with client(edge) as ws:
            fw.est_wait_s[1] = 7.5  # tier p1 over its 2 s objective
            await fw.send_status()
            await wait_for(lambda: edge.shedder.check(1, time.monotonic()) is not None)  # the edge read it
            await send(ws, gen("a", 2))
            err = await recv(ws)
            assert err["code"] == "overloaded" and err["retry_after"] == pytest.approx(5.5)
            assert "estimated wait" in err["message"]
            with pytest.raises(InvalidStatus) as ei:  # new p1 connections: 503
                async with client(edge):
                    pass
            assert ei.value.response.status_code == 503
            assert int(ei.value.response.headers["Retry-After"]) >= 5
            async with client(edge, KEY_P0) as vip:  # p0 is within its objective
                await send(vip, gen("v", 2))
                assert (await recv(vip))["type"] == "accepted"
            fw.est_wait_s[1] = 0.0
            await fw.send_status()
            await wait_for(lambda: edge.shedder.check(1, time.monotonic()) is None)  # the edge read it
            await send(ws, gen("b", 2))  # the connection stayed usable
            assert (await recv(ws))["type"] == "accepted"
        # the worker dies: no heartbeats -> not ready, overloaded
        await fw.stop()
        await wait_for(lambda: not edge.shedder.live(time.monotonic()))  # its last heartbeat went stale (0.5 s)
        status, _, body = await http_get(edge, "/readyz")
        assert status == 503 and "no live worker" in body
        with pytest.raises(InvalidStatus) as ei:
            async with client(edge):
                pass
        assert ei.value.response.status_code == 503


async def test_readyz_without_any_worker(encoder):
    async with running_edge(encoder, worker=False) as (edge, _):
        status, _, body = await http_get(edge, "/readyz")
        assert status == 503 and "no worker heartbeat" in body
        status, _, body = await http_get(edge, "/healthz")
        assert status == 200


async def test_http_endpoints(encoder):
    async with running_edge(encoder) as (edge, _):
        async with client(edge) as ws:
            await send(ws, gen("a", 4))
            await collect(ws, "a")
        status, headers, body = await http_get(edge, "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        for name in ("lockgate:time_to_first_token_seconds_bucket", "lockgate:e2e_request_latency_seconds_count",
                     "lockgate:edge_connections", "lockgate:generation_tokens_total", "lockgate:edge_rejections"):
            assert name in body, name
        assert 'model="tiny",tier="p1"' in body
        status, headers, body = await http_get(edge, "/")
        assert status == 200 and headers["Content-Type"].startswith("text/html") and "<script>" in body
        status, _, _ = await http_get(edge, "/nope")
        assert status == 404


def _cancels(bus, edge):
    t = bus.broker.topics[edge.config.layout.control_topic]
    return [decode(r.value) for p in t.partitions for r in p.read(p.start, len(p))]


async def test_cancel_publishes_cancel(encoder):
    async with running_edge(encoder, worker_kw={"step_s": 0.02}) as (edge, fw):
        async with client(edge) as ws:
            await send(ws, gen("a", 500))
            acc = await recv(ws)
            await recv(ws)  # a first delta
            await send(ws, {"type": "cancel", "id": "a"})
            _, _, done = await collect(ws, "a")
            assert done["type"] == "done" and done["finish_reason"] == "abort"
            await wait_for(lambda: any(c.request_id == acc["request_id"] for c in fw.cancels))
            assert fw.cancels[0] == Cancel(acc["request_id"], "client")
            assert acc["request_id"] not in fw.running
            await send(ws, {"type": "cancel", "id": "zzz"})  # unknown id: an error, connection usable
            err = await recv(ws)
            assert err["code"] == "invalid_request" and err["field"] == "id"


async def test_disconnect_publishes_cancel(encoder):
    async with running_edge(encoder, worker_kw={"step_s": 0.02}) as (edge, fw):
        ws = await client(edge)
        await send(ws, gen("a", 500))
        await send(ws, gen("b", 500))
        rids = {(await recv(ws))["request_id"], (await recv(ws))["request_id"]}
        await ws.close()
        await wait_for(lambda: {c.request_id for c in fw.cancels} == rids)
        assert all(c.reason == "disconnect" for c in fw.cancels)
        await wait_for(lambda: not edge.admission.router.streams and not edge.sessions)


async def test_dedupe_after_worker_restart(encoder):
    async with running_edge(encoder, worker_kw={"replay_after": 6}) as (edge, fw):
        async with client(edge) as ws:
            await send(ws, gen("a", 15, token_ids=True))
            await recv(ws)
            text, deltas, done = await collect(ws, "a")
            assert text == expected_text(fw.seen[0].prompt_token_ids, 15)
            seqs = [s for d in deltas for s in range(d["seq"], d["seq"] + len(d["token_ids"]))]
            assert seqs == list(range(15))  # each token exactly once
            assert done["usage"]["completion_tokens"] == 15
            assert "lockgate:edge_duplicate_chunks_total 6.0" in edge.metrics.render().decode()


async def test_worker_error_is_forwarded(encoder):
    async with running_edge(encoder, worker_kw={"error": "expired"}) as (edge, _):
        async with client(edge) as ws:
            await send(ws, gen("a", 4))
            await recv(ws)
            err = await recv(ws)
            assert err["type"] == "error" and err["code"] == "expired" and err["id"] == "a"


async def test_validation_errors_keep_connection(encoder):
    async with running_edge(encoder) as (edge, _):
        async with client(edge) as ws:
            await send(ws, gen("a", 4, model="other"))
            assert (await recv(ws))["field"] == "model"
            await send(ws, {"type": "generate", "id": "b", "prompt": "word " * 2000})
            err = await recv(ws)
            assert err["field"] == "prompt" and "context is 1024" in err["message"]
            await send(ws, gen("c", 4, temperature="hot"))
            assert (await recv(ws))["field"] == "temperature"
            await send(ws, gen("d", 100_000))  # past the context: refused, naming the limit (#38)
            err = await recv(ws)
            assert err["type"] == "error" and err["id"] == "d" and err["field"] == "max_tokens"
            assert "context length 1024" in err["message"], err
            await send(ws, gen("e", 8))  # the connection still serves
            acc = await recv(ws)
            assert acc["type"] == "accepted" and acc["max_tokens"] == 8


async def test_duplicate_client_id(encoder):
    async with running_edge(encoder, worker_kw={"step_s": 0.05}) as (edge, _):
        async with client(edge) as ws:
            await send(ws, gen("a", 50))
            await recv(ws)
            await send(ws, gen("a", 50))
            f = await recv(ws)
            while f["type"] == "delta":
                f = await recv(ws)
            assert f["type"] == "error" and f["field"] == "id"


async def test_oversize_frame_closes_1009(encoder):
    async with running_edge(encoder, max_frame_bytes=4096) as (edge, _):
        async with client(edge) as ws:
            await ws.send("x" * 5000)
            with pytest.raises(ConnectionClosed) as ei:
                await recv(ws)
            assert ei.value.rcvd.code == 1009


async def test_slow_client_is_disconnected(encoder):
    big = "x" * 4096 + " "
    # step_s: every request streams for >= 5 s, so all 8 are still in flight when the edge gives up
    # on the client (a worker that finished them first would leave nothing to cancel).
    async with running_edge(encoder, send_queue_frames=8, slow_client_grace_s=0.3, close_timeout_s=0.5,
                            worker_kw={"token_text": lambda p, i: big, "step_s": 0.005}) as (edge, fw):
        # max_queue=1: the client stops reading from the socket as soon as one frame is waiting.
        async with client(edge, max_queue=1) as ws:
            for i in range(8):
                await send(ws, gen(f"s{i}", 1000))
            await wait_for(lambda: 'lockgate:edge_slow_client_disconnects_total 1.0' in edge.metrics.render().decode(),
                           timeout=20)
            await wait_for(lambda: not edge.sessions and not edge.admission.router.streams, timeout=10)
            await wait_for(lambda: len({c.request_id for c in fw.cancels}) == 8)
            assert all(c.reason == "disconnect" for c in fw.cancels)
            await wait_for(lambda: not fw.running)  # the worker stopped generating for the gone client
            # the edge did not buffer without bound and is still serving others
            async with client(edge) as ok:
                await send(ok, gen("fine", 3))
                await recv(ok)
                _, _, done = await collect(ok, "fine")
                assert done["type"] == "done"


async def test_start_stop_idempotent_and_embeddable(encoder):
    from bus import MemoryBus
    from devtools.fake_worker import FakeWorker
    from edge.config import EdgeConfig
    from edge.server import Edge

    bus = MemoryBus()
    await bus.start()
    edge = Edge(EdgeConfig(model="tiny", port=0), bus, encoder)
    await edge.start()
    await edge.start()
    await FakeWorker(bus, "tiny").send_status()  # one heartbeat: a live worker
    await wait_for(lambda: edge.readiness()[0])
    ws = await connect(url(edge))
    await edge.stop()
    await edge.stop()
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(ws.recv(), 5)
    assert ws.close_code == 1001
    assert all(t.done() for t in edge._tasks) and not edge._tasks
    await bus.stop()
