"""Fleet-wide key limits over real Kafka: two edges (each with its own bus connection) and a fake
worker; one key's requests_per_min and max_streams hold across both edges within the documented
tolerance (docs/protocol.md, "Fleet-wide limits": 10 % of the limit over a window, plus what one
refill brings), where per-process limits would admit twice as much. Bounded in count and time."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from bus import Bus, connect
from devtools.fake_worker import FakeWorker
from edge.config import EdgeConfig, KeyEntry, hash_key
from edge.server import Edge
from tests.edge.conftest import MODEL, recv, send, wait_for
from tests.engine_workers.worker.test_worker_kafka import kafka_url, new_layout
from tests.waiting import wait_until_sync

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

KEY = "lg-fleet-test-key"
TOLERANCE = 0.10  # the documented tolerance


@contextlib.asynccontextmanager
async def two_edges(bootstrap: str, encoder, entry: KeyEntry, step_s: float) -> AsyncIterator[tuple[Edge, Edge]]:
    layout = new_layout(2)
    async with contextlib.AsyncExitStack() as stack:
        buses: list[Bus] = [await stack.enter_async_context(connect(kafka_url(bootstrap))) for _ in range(3)]
        await buses[0].ensure_topics(layout.model_specs(MODEL))
        fw = FakeWorker(buses[0], MODEL, layout, step_s=step_s)
        await fw.start()
        stack.push_async_callback(fw.stop)
        edges = []
        for i in (1, 2):
            cfg = EdgeConfig(model=MODEL, port=0, layout=layout, ping_interval_s=None, edge_id=f"fleet-{i}",
                             keys={entry.key_hash: entry}, fleet_sync_interval_s=0.2, fleet_edge_stale_s=2.0)
            edges.append(await stack.enter_async_context(Edge(cfg, buses[i], encoder)))
        a, b = edges
        await wait_for(lambda: a.readiness()[0] and b.readiness()[0], timeout=30)
        # each edge has read the other's heartbeat: both split the key the same way
        await wait_for(lambda: a.limiter.fleet.live_edges() == 2 and b.limiter.fleet.live_edges() == 2,  # type: ignore[union-attr]
                       timeout=15)
        yield a, b


def client(edge: Edge) -> ws_connect:
    return ws_connect(f"ws://127.0.0.1:{edge.port}/ws", additional_headers={"Authorization": f"Bearer {KEY}"})


async def attempt(ws: ClientConnection, cid: str, max_tokens: int) -> dict:
    """Send one generate; its first answer (accepted or error), skipping other requests' frames."""
    await send(ws, {"type": "generate", "id": cid, "prompt": "hello fleet", "max_tokens": max_tokens,
                    "ignore_eos": True})
    while True:
        f = await recv(ws, 10.0)
        if f.get("id") == cid and f["type"] in ("accepted", "error"):
            return f


async def test_requests_per_min_holds_across_two_edges(kafka_bootstrap: str, encoder) -> None:
    limit = 30
    entry = KeyEntry(hash_key(KEY), "acme", 1, requests_per_min=limit, tokens_per_min=0, max_streams=0)
    async with two_edges(kafka_bootstrap, encoder, entry, 0.0) as (a, b):
        async with client(a) as wa, client(b) as wb:
            accepted = refused = 0
            t0 = time.monotonic()
            for i in range(4 * limit):  # twice the limit per edge: per-process limits would admit 2 x limit
                f = await attempt(wa if i % 2 == 0 else wb, f"r{i}", 1)
                if f["type"] == "accepted":
                    accepted += 1
                else:
                    assert f["code"] == "rate_limited" and f["field"] == "requests_per_min", f
                    refused += 1
            elapsed = time.monotonic() - t0
    # one bucket of the key: `limit` at once, refilled at limit/60 per second
    allowed = limit + limit * elapsed / 60
    assert accepted <= math.ceil(allowed * (1 + TOLERANCE)), (accepted, allowed, elapsed)
    assert accepted >= limit // 2, (accepted, allowed)  # the edges did not starve the key either
    assert refused > 0


async def test_max_streams_holds_across_two_edges_and_follows_demand(kafka_bootstrap: str, encoder) -> None:
    limit = 4
    entry = KeyEntry(hash_key(KEY), "acme", 1, requests_per_min=0, tokens_per_min=0, max_streams=limit)
    async with two_edges(kafka_bootstrap, encoder, entry, 0.05) as (a, b):
        fa, fb = a.limiter.fleet, b.limiter.fleet
        assert fa is not None and fb is not None
        # both have published a heartbeat counting the other: each reserves its even share, 2 of 4
        await wait_for(lambda: fa.share(entry, time.monotonic()).streams == 2 and fb.share(entry, time.monotonic()).streams == 2, timeout=15)
        async with client(a) as wa, client(b) as wb:
            # long streams (1000 tokens at 20/s), sent to both edges in turn: at most `limit` run at once
            accepted: list[tuple[ClientConnection, str]] = []
            for i in range(3 * limit):
                ws = wa if i % 2 == 0 else wb
                f = await attempt(ws, f"s{i}", 1000)
                if f["type"] == "accepted":
                    accepted.append((ws, f"s{i}"))
                else:
                    assert f["code"] == "rate_limited" and f["field"] == "max_streams", f
                held = sum(e.limiter.in_flight().get(entry.key_hash, 0) for e in (a, b))
                assert held <= limit, held
            assert len(accepted) <= limit  # 10 % of 4 rounds to no slack at all
            assert len(accepted) >= limit // 2
            for ws, cid in accepted:
                await send(ws, {"type": "cancel", "id": cid})
            await wait_for(lambda: not a.limiter.in_flight() and not b.limiter.in_flight(), timeout=15)

            # now the key is used on edge a only: its refusals there count as demand, and within a
            # few heartbeats a holds (nearly) all of the key's streams, still never more than the limit
            on_a: list[str] = []
            deadline = time.monotonic() + 20
            i = 0
            while len(on_a) < limit - 1 and time.monotonic() < deadline:
                i += 1
                f = await attempt(wa, f"x{i}", 1000)
                if f["type"] == "accepted":
                    on_a.append(f"x{i}")
                held = sum(e.limiter.in_flight().get(entry.key_hash, 0) for e in (a, b))
                assert held <= limit, held
                if f["type"] == "error":
                    await asyncio.sleep(0.05)  # a client's back-off; the rebalance is what is waited for
            assert len(on_a) >= limit - 1, on_a
            for cid in on_a:
                await send(wa, {"type": "cancel", "id": cid})


async def test_a_stopping_edge_frees_its_share_at_once(kafka_bootstrap: str, encoder) -> None:
    entry = KeyEntry(hash_key(KEY), "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=0)
    async with two_edges(kafka_bootstrap, encoder, entry, 0.0) as (a, b):
        fleet = a.limiter.fleet
        assert fleet is not None and fleet.share(entry, time.monotonic()).rate == pytest.approx(0.5)
        await b.stop()  # its last heartbeat says `gone`
        await wait_for(lambda: fleet.live_edges() == 1, timeout=5)
        assert fleet.share(entry, time.monotonic()).rate == 1.0


async def test_limits_fail_closed_while_the_bus_is_away_and_recover(private_kafka, encoder) -> None:
    """The broker stopped: neither edge reads its own heartbeat back, so after ``stale_s`` each
    refuses the limited key (503 ``overloaded``, field ``fleet_limits``) rather than guess its
    share; a key without limits is unaffected. The broker back: both edges see each other again,
    split the key as before, and serve it."""
    entry = KeyEntry(hash_key(KEY), "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=4)
    free = KeyEntry(hash_key("lg-unlimited"), "free", 1, requests_per_min=0, tokens_per_min=0, max_streams=0)
    async with two_edges(private_kafka.bootstrap, encoder, entry, 0.0) as (a, b):
        fa, fb = a.limiter.fleet, b.limiter.fleet
        assert fa is not None and fb is not None
        await private_kafka.stop()
        await wait_for(lambda: not fa.fresh(time.monotonic()) and not fb.fresh(time.monotonic()), timeout=15)
        for e in (a, b):
            refused = e.limiter.admit(entry, 1, time.monotonic())
            assert refused is not None and refused.overloaded and refused.field == "fleet_limits"
            assert e.limiter.admit(free, 1, time.monotonic()) is None
        assert fa.live_edges() == 2 and fb.live_edges() == 2  # silence expires no peer
        await private_kafka.start()
        await wait_for(lambda: fa.fresh(time.monotonic()) and fb.fresh(time.monotonic()), timeout=60)
        assert fa.live_edges() == 2 and fa.share(entry, time.monotonic()).rate == pytest.approx(0.5)
        await wait_for(lambda: a.readiness()[0], timeout=30)  # the fake worker's heartbeats are back too
        async with client(a) as wa:
            f = await attempt(wa, "after", 2)
            assert f["type"] == "accepted", f


VICTIM = """
import asyncio, sys
from bus import TopicLayout, connect
from edge.config import EdgeConfig, KeyEntry
from edge.server import Edge

async def main() -> None:
    ns, bootstrap, path, key_hash = sys.argv[1:5]
    entry = KeyEntry(key_hash, "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=0)
    cfg = EdgeConfig(model="tiny", model_path=path, port=0, layout=TopicLayout(namespace=ns, partitions=2),
                     keys={key_hash: entry}, edge_id="victim", fleet_sync_interval_s=0.2, fleet_edge_stale_s=2.0)
    async with connect(f"kafka://{bootstrap}") as bus, Edge(cfg, bus):
        print("ready", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_killed_edge_keeps_its_share_until_stale_then_frees_it(kafka_bootstrap: str, encoder, tiny_path) -> None:
    """kill -9 an edge (no `gone` heartbeat): the survivor keeps counting it (its clients' streams
    may still be winding down) until `fleet_edge_stale_s` of its own heartbeats have come back,
    then takes the whole key."""
    entry = KeyEntry(hash_key(KEY), "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=0)
    layout = new_layout(2)
    async with connect(kafka_url(kafka_bootstrap)) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.edges_spec()])
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        proc = subprocess.Popen([sys.executable, "-c", VICTIM, layout.namespace, kafka_bootstrap, tiny_path,
                                 entry.key_hash], stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            assert line.strip() == "ready", line
            cfg = EdgeConfig(model=MODEL, port=0, layout=layout, ping_interval_s=None, edge_id="survivor",
                             keys={entry.key_hash: entry}, fleet_sync_interval_s=0.2, fleet_edge_stale_s=2.0)
            async with Edge(cfg, bus, encoder) as a:
                fleet = a.limiter.fleet
                assert fleet is not None
                await wait_for(lambda: fleet.live_edges() == 2, timeout=15)
                assert fleet.share(entry, time.monotonic()).rate == pytest.approx(0.5)
                proc.send_signal(signal.SIGKILL)
                assert fleet.live_edges() == 2  # silence alone frees nothing at once
                await asyncio.to_thread(proc.wait, 30)
                await wait_for(lambda: fleet.live_edges() == 1, timeout=15)
                assert fleet.share(entry, time.monotonic()).rate == 1.0
        finally:
            if proc.poll() is None:
                proc.kill()
                wait_until_sync(lambda: proc.poll() is not None, timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
