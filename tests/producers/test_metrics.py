"""After traffic, /metrics of the edge and of the worker expose the issue's metrics with non-zero
counts (real Kafka; edge and worker in this process, each with its own registry and HTTP port)."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import bus as busmod
from benchmarks.serving.targets import Prompt, WsTarget
from edge.config import EdgeConfig, KeyEntry, hash_key
from edge.server import Edge
from tests.producers.conftest import fake_worker_mode, serving
from tests.waiting import wait_until

pytestmark = pytest.mark.kafka

KEYS = {t: f"lg-metrics-p{t}" for t in (0, 1, 2)}

EDGE_NONZERO = [  # (family, sample suffix) that must have a non-zero sample after traffic
    ("lockgate:time_to_first_token_seconds", "_count"), ("lockgate:time_per_output_token_seconds", "_count"),
    ("lockgate:e2e_request_latency_seconds", "_count"), ("lockgate:prompt_tokens", "_total"),
    ("lockgate:generation_tokens", "_total"), ("lockgate:request_success", "_total"),
    ("lockgate:edge_rejections", "_total"), ("lockgate:edge_connections", ""),
]
WORKER_NONZERO = [
    ("lockgate:time_to_first_token_seconds", "_count"), ("lockgate:time_per_output_token_seconds", "_count"),
    ("lockgate:e2e_request_latency_seconds", "_count"), ("lockgate:request_queue_time_seconds", "_count"),
    ("lockgate:prompt_tokens", "_total"), ("lockgate:generation_tokens", "_total"),
    ("lockgate:prefix_cache_queries", "_total"), ("lockgate:prefix_cache_hits", "_total"),
    ("lockgate:request_success", "_total"), ("lockgate:iteration_tokens_total", "_count"),
    ("lockgate:iteration_seqs", "_count"),
]
WORKER_PRESENT = ["lockgate:kv_cache_usage_perc", "lockgate:num_requests_running", "lockgate:num_requests_waiting",
                  "lockgate:num_preemptions"]


def scrape(port: int) -> dict[str, list]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(body)}


def nonzero(fams: dict[str, list], name: str, suffix: str) -> bool:
    return any(s.name == name + suffix and s.value > 0 for s in fams.get(name, []))


@pytest.mark.skipif(fake_worker_mode(), reason="worker metrics need the real worker")
async def test_metrics_after_traffic(kafka_bootstrap, tiny_model, layout):
    entries = {hash_key(k): KeyEntry(hash_key(k), f"m-p{t}", t, 0, 0, 0) for t, k in KEYS.items()}
    b = busmod.connect(f"kafka://{kafka_bootstrap}")
    await b.start()
    try:
        async with serving(b, tiny_model, layout, metrics_port=0) as worker:
            cfg = EdgeConfig(model=tiny_model.name, model_path=str(tiny_model), port=0, keys=entries, layout=layout,
                             ping_interval_s=None)
            async with Edge(cfg, b) as edge:
                await wait_until(lambda: edge.readiness()[0], timeout=30, interval=0.1)
                target = WsTarget(f"ws://127.0.0.1:{edge.port}/ws", KEYS, connections_per_tier=1)
                await target.start()
                try:
                    # the same 40-token prompt twice per tier: the repeats hit the prefix cache
                    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 5)
                    for tier in (0, 1, 2, 0, 1, 2):
                        t = await asyncio.wait_for(target.run_one(Prompt(tier, tier, text, (), 5)), 30)
                        assert t.ok and t.output_tokens == 5, t
                    bad = urllib.request.Request(f"http://127.0.0.1:{edge.port}/ws", headers={
                        "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                        "Sec-WebSocket-Version": "13", "Authorization": "Bearer wrong"})
                    with pytest.raises(urllib.error.HTTPError):  # one rejected handshake (401)
                        await asyncio.to_thread(urllib.request.urlopen, bad, timeout=5)
                    edge_fams = await asyncio.to_thread(scrape, edge.port)
                finally:
                    await target.stop()
                worker_fams = await asyncio.to_thread(scrape, worker._health.port)
    finally:
        await b.stop()
    missing = [n + s for n, s in EDGE_NONZERO if not nonzero(edge_fams, n, s)]
    assert not missing, f"edge metrics missing or zero: {missing}"
    missing = [n + s for n, s in WORKER_NONZERO if not nonzero(worker_fams, n, s)]
    assert not missing, f"worker metrics missing or zero: {missing}"
    assert not [n for n in WORKER_PRESENT if n not in worker_fams]
    tiers = {s.labels.get("tier") for s in edge_fams["lockgate:time_to_first_token_seconds"] if s.name.endswith("_count")}
    assert len(tiers) == 3
