"""A leader failover mid-stream on a 3-broker cluster (replication 3): the broker that leads the
request and reply partitions stops, then comes back. No dead letter, no token lost or repeated,
every request answered (issue #22)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from bus import Finished, InferenceRequest, SamplingParams, TopicLayout, connect, read_dead_letters
from devtools import kafka_local
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.conftest import THREE_NODE_PORT
from tests.engine_workers.worker.test_worker_kafka import assert_exact_streams
from tests.engine_workers.worker.test_worker_memory import MODEL, Replies, make_engine, publish, tiny_dir  # noqa: F401 - pytest fixtures, used by name
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


async def _leaders(bootstrap: str, topics: list[str]) -> dict[tuple[str, int], int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        out = {}
        for t in await admin.describe_topics(topics):
            for p in t["partitions"]:
                out[(t["topic"], p["partition"])] = p["leader"]
        return out
    finally:
        await admin.close()


async def test_leader_failover_mid_stream_loses_nothing(three_brokers, tiny_dir: Path) -> None:
    layout = TopicLayout(namespace=f"t{uuid.uuid4().hex[:8]}", partitions=2, replication=3)
    url = f"kafka://{three_brokers.bootstrap}?session_timeout_ms=6000&linger_ms=1&fetch_max_wait_ms=50"
    reqs = [InferenceRequest(f"f{i}", MODEL, tuple(range(5 + i, 21 + i)),
                             SamplingParams(max_tokens=60, temperature=0.8, ignore_eos=True).seeded(),
                             layout.reply_topic("test"), tier=1, enqueued_at=time.time()) for i in range(4)]
    engine = make_engine(tiny_dir)
    ref = engine.generate([r.prompt_token_ids for r in reqs], [r.sampling for r in reqs])
    reply_topic, req_topic = layout.reply_topic("test"), layout.request_topic(MODEL, 1)
    async with connect(url) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test", 1)])
        replies = Replies(bus, reply_topic)
        await replies.consumer.start()
        # 40 ms a step (a sleep: the step loop's pacing, not synchronisation): ~2.4 s of streaming
        async with Worker(WorkerConfig(MODEL, layout=layout, heartbeat_s=0.2), bus, engine,
                          before_step=lambda: time.sleep(0.04)) as w:
            await wait_until(lambda: w.ready(), timeout=60, message="worker holding partitions")
            for r in reqs:
                await publish(bus, layout, r)
            await replies.wait_streaming(60, "no tokens before the failover")
            leaders = await _leaders(three_brokers.bootstrap, [reply_topic, req_topic])
            victim = leaders[(reply_topic, 0)]  # the reply partition's leader; it leads request partitions too
            assert victim >= 0
            pid = kafka_local.stop_node(victim, 3, THREE_NODE_PORT, kafka_local.DEFAULT_DIR)
            assert pid is not None
            await wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout=60, interval=0.2,
                             message="the stopped broker gone")
            before = len(replies.chunks)

            async def streaming_on() -> bool:
                await replies.poll(100)
                return len(replies.chunks) >= before + 8 or len(replies.final) == len(reqs)

            # the partitions' new leaders take over: tokens keep arriving while the broker is down
            await wait_until(streaming_on, timeout=90, interval=0, message="tokens after the leader stopped")
            await asyncio.to_thread(kafka_local.start, 3, THREE_NODE_PORT, kafka_local.DEFAULT_DIR, 180.0)
            await replies.wait([r.request_id for r in reqs], 180)
            for r, expected in zip(reqs, ref):
                fin = replies.final[r.request_id]
                assert isinstance(fin, Finished) and fin.num_tokens == len(expected.token_ids), fin
            assert_exact_streams(replies, reqs, ref)  # nothing lost; a repeat only with the same token
            # with the broker back, a new request is served too
            late = InferenceRequest("late", MODEL, (7, 8, 9), SamplingParams(max_tokens=5, temperature=0.0),
                                    reply_topic, tier=1, enqueued_at=time.time())
            await publish(bus, layout, late)
            await replies.wait(["late"], 60)
            assert isinstance(replies.final["late"], Finished) and replies.final["late"].num_tokens == 5
            assert "lockgate:dead_letters_total 0.0" in w.render_metrics().decode()
        letters, _ = await read_dead_letters(bus, layout, since_ms=0, until_ms=int(time.time() * 1000) + 1000)
        assert letters == []
