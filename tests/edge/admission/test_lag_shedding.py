"""Lag-aware shedding: a backlog on the request topic (records the workers have not fetched yet)
reaches the edge through the heartbeats' consumer lag, and the edge sheds new requests with
``overloaded`` within a heartbeat or two (memory bus, real worker on the tiny model)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from websockets.exceptions import InvalidStatus

from bus import InferenceRequest, MemoryBus, SamplingParams, TopicLayout, encode
from edge.config import EdgeConfig
from edge.request import PromptEncoder
from edge.server import Edge
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.edge.conftest import client, keys, recv, send, wait_for
from tests.engine_workers.worker.test_worker_memory import MODEL, make_engine, tiny_dir  # noqa: F401 - pytest fixture, used by name


async def test_a_topic_backlog_sheds_new_requests_within_a_heartbeat(tiny_dir: Path) -> None:
    layout = TopicLayout()
    engine = make_engine(tiny_dir, max_num_seqs=2)
    heartbeat = 0.1
    async with MemoryBus() as bus:
        # 20 ms a step (the step loop's pacing): the backlog below takes far longer than the p1 objective
        async with Worker(WorkerConfig(MODEL, layout=layout, heartbeat_s=heartbeat), bus, engine,
                          before_step=lambda: time.sleep(0.02)) as w:
            config = EdgeConfig(model=MODEL, port=0, keys=keys(), ping_interval_s=None, slo_wait_s=(2.0, 5.0, 60.0))
            async with Edge(config, bus, PromptEncoder.from_path(str(tiny_dir))) as edge:
                await wait_for(lambda: edge.readiness()[0])
                early = await client(edge)
                topic = layout.request_topic(MODEL, 1)
                await bus.ensure_topics([layout.reply_spec("elsewhere")])
                for i in range(200):  # a backlog published straight to the topic (a batch job, a replay)
                    r = InferenceRequest(f"bk{i}", MODEL, (5, 6, 7, 8), SamplingParams(max_tokens=16, temperature=0.0,
                                         ignore_eos=True), layout.reply_topic("elsewhere"), tier=1,
                                         enqueued_at=time.time())
                    await bus.send(topic, encode(r), key=r.request_id.encode())
                published = time.monotonic()
                await wait_for(lambda: edge.shedder.check(1, time.monotonic()) is not None, timeout=10)
                noticed = time.monotonic() - published
                # once the worker's admission rate is established (a few requests a second), its
                # estimate without the lag would be within the objective: the lag is what sheds
                await wait_for(lambda: w.stages.pipeline.admission.rate.rate(time.time()) >= 3.0, timeout=20)
                status = w.status()
                assert sum(status.lag) > 100  # most of the backlog still on the topic
                blind = w.stages.pipeline.admission.status(w.config.worker_id, MODEL, False)
                assert blind.est_wait_s[1] <= 5.0 < status.est_wait_s[1], (blind.est_wait_s, status.est_wait_s)
                # a new client of the shed tier is refused at the handshake (503 + Retry-After)
                with pytest.raises(InvalidStatus) as refused:
                    async with client(edge):
                        pass
                assert refused.value.response.status_code == 503
                assert float(refused.value.response.headers["Retry-After"]) >= 1
                # and a request on a connection opened before is answered ``overloaded``
                await send(early, {"type": "generate", "id": "late", "prompt": "hello", "max_tokens": 4})
                err = await recv(early)
                await early.close()
                assert err["type"] == "error" and err["code"] == "overloaded" and err["retry_after"] >= 1
                assert noticed < 10 * heartbeat + 1.0, noticed  # within a heartbeat or two (plus scheduling)
