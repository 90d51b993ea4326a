"""Replay on real Kafka: record traffic through a worker, replay the window at 4x, every request
re-runs and greedy outputs match the recorded replies."""

from __future__ import annotations

import asyncio
import time

import pytest

import bus as busmod
from bus import InferenceRequest, SamplingParams, encode, parse_time_ms
from producers.collector import ReplyCollector
from producers.replay import ReplayConfig, replay_id, run_replay
from tests.producers.conftest import serving
from tests.waiting import wait_until


def test_parse_time_forms():
    assert parse_time_ms("1700000000000") == 1700000000000
    assert parse_time_ms("2024-01-01T00:00:00Z") == 1704067200000
    assert parse_time_ms("2024-01-01T00:00:00") == 1704067200000  # naive = UTC
    assert parse_time_ms("-15m", now_ms=1_000_000) == 100_000
    assert parse_time_ms("15m", now_ms=1_000_000) == 100_000  # "ago" without the minus argparse mistakes
    assert parse_time_ms("1.5s", now_ms=10_000) == 8_500 and parse_time_ms("2h", now_ms=8_000_000) == 800_000
    assert parse_time_ms("now", now_ms=5) == 5
    with pytest.raises(ValueError):
        parse_time_ms("yesterday")
    with pytest.raises(ValueError):
        parse_time_ms("15x")


@pytest.mark.parametrize("since", [["--since", "15m"], ["--since=-15m"]])
def test_replay_command_line_takes_relative_times(since):
    from lockgate.cli import build_parser

    args = build_parser().parse_args(["replay", "--topic", "t", *since])
    assert parse_time_ms(args.since, now_ms=1_000_000) == 100_000
    assert replay_id("edge-1-a", "r1") == "edge-1-a.replay-r1"


@pytest.mark.kafka
async def test_replay_reruns_everything_and_greedy_matches(kafka_bootstrap, tiny_model, tokenizer, layout):
    model = tiny_model.name
    b = busmod.connect(f"kafka://{kafka_bootstrap}")
    await b.start()
    try:
        async with serving(b, tiny_model, layout):
            rec_topic = layout.reply_topic("recorded-edge")
            await b.ensure_topics(layout.model_specs(model) + [layout.reply_spec("recorded-edge")])
            col = ReplyCollector(b, rec_topic)
            await col.start()
            since = int(time.time() * 1000) - 1
            futs, n = [], 12
            for i in range(n):
                greedy = i % 4 != 3  # 9 greedy, 3 sampled
                sp = SamplingParams(max_tokens=6 + i % 5, temperature=0.0 if greedy else 0.8, seed=None if greedy else i)
                req = InferenceRequest(request_id=f"orig-{i}", model=model,
                                       prompt_token_ids=tuple(tokenizer.text(f"The quick brown fox {i} jumps")),
                                       sampling=sp, reply_to=rec_topic, tier=i % 3, enqueued_at=time.time())
                futs.append(col.expect(req.request_id))
                await b.send(layout.request_topic(model, req.tier), encode(req), key=req.request_id.encode())
                await asyncio.sleep(0.04)  # not synchronisation: paces the recorded traffic the replay re-times
            originals = await asyncio.wait_for(asyncio.gather(*futs), 60)
            await col.stop()
            assert all(r.ok and r.token_ids for r in originals)
            until = int(time.time() * 1000)
            t0 = time.monotonic()
            cfg = ReplayConfig(bus_url="", topics=tuple(layout.request_topics(model)), since_ms=since, until_ms=until,
                               speed=4.0, layout=layout, idle_s=1.5, request_timeout_s=60, originals_timeout_s=15)
            rep = await asyncio.wait_for(run_replay(cfg, source=b, target=b), 80)
            assert rep["recorded"] == n and rep["replayed"] == n, rep
            assert rep["completed"] == n and rep["failed"] == 0, rep["errors"]
            g = rep["greedy"]
            assert (g["requests"], g["match"], g["mismatch"], g["unavailable"]) == (9, 9, 0, 0), g
            assert {r["request_id"] for r in rep["requests"]} == {replay_id(f"orig-{i}", rep["run_id"]) for i in range(n)}
            assert rep["latency"]["ttft_ms"]["count"] == n and rep["latency"]["e2e_ms"]["p99"] > 0
            assert set(rep["latency_by_tier"]) == {"p0", "p1", "p2"}
            assert time.monotonic() - t0 < 60
            # every replayed request was answered: the run's own reply topic is gone, the recorded one
            # stays. Kafka's broker metadata catches up with the controller's delete: bounded wait.
            async def only_recorded_left() -> bool:
                return await b.list_topics(f"{layout.namespace}.reply.") == [rec_topic]

            await wait_until(only_recorded_left, timeout=15, interval=0.1,
                             message="the replay's reply topic deleted, the recorded one kept")
    finally:
        await b.stop()
