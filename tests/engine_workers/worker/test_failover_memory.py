"""Takeover on the in-process bus: a "ghost" peer holds partitions of the group (a bare group
consumer that never commits) and beats as a worker would; once it falls silent, the real worker
takes over its requests within the detection time, fenced by a higher attempt, and when the
ghost finally leaves the group nothing runs twice."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus import Finished, MemoryBus, PartitionHold, TopicLayout, WorkerStatus, encode, partition_for_key
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.engine_workers.worker.test_worker_memory import (
    MODEL,
    Replies,
    layout,  # noqa: F401 - a fixture
    make_engine,
    req,
    tiny_dir,  # noqa: F401 - a fixture
)
from tests.waiting import wait_until


@pytest.mark.parametrize("same_numerics", [True, False], ids=["same-numerics", "mixed-fleet"])
async def test_silent_peer_requests_taken_over_then_nothing_runs_twice(tiny_dir, layout: TopicLayout,
                                                                       same_numerics: bool) -> None:
    """``mixed-fleet``: the ghost advertises another numerics fingerprint and no live worker matches
    it: its requests are still taken over (served, not stranded; docs/worker.md, "Mixed fleets")."""
    async with MemoryBus() as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test", 1)])
        cfg = WorkerConfig(MODEL, layout=layout, worker_id="live", heartbeat_s=0.05, commit_interval_s=0)
        # the ghost joins the group first and keeps half the partitions (it never polls again)
        ghost = bus.consumer(layout.request_topics(MODEL), group_id=cfg.group, start_from="earliest")
        await ghost.start()
        async with Worker(cfg, bus, make_engine(tiny_dir)) as w:
            async def split() -> bool:
                await ghost.getmany(timeout_ms=10)
                return bool(ghost.assignment()) and bool(w._consumer and w._consumer.assignment())

            await wait_until(split, timeout=10, interval=0.02, message="the group never split")
            mine = ghost.assignment()
            topic = layout.request_topic(MODEL, 1)
            held = sorted(tp.partition for tp in mine if tp.topic == topic)
            assert held
            # requests keyed onto the ghost's partitions of tier 1
            n_parts = layout.partitions
            rids = [f"r{i}" for i in range(200) if partition_for_key(f"r{i}".encode(), n_parts) in held][:4]
            since = int(time.time() * 1000) - 1000
            for rid in rids:
                r = req(rid, layout, max_tokens=16)
                await bus.send(topic, encode(r), key=rid.encode())
            holds = tuple(PartitionHold(tp.topic, tp.partition, since) for tp in sorted(mine))
            assert w.stages.takeover is not None
            numerics = w.stages.takeover.config.numerics if same_numerics else "cuda/bfloat16/none/kv=auto/tp=2"
            for _ in range(4):  # a steady ghost
                await bus.send(layout.status_topic, encode(WorkerStatus("ghost", MODEL, time.time(), holds=holds,
                                                                        numerics=numerics)))
                await asyncio.sleep(0.05)
            replies = Replies(bus, layout.reply_topic("test"))
            await replies.consumer.start()
            silent_at = time.monotonic()
            await replies.wait(rids, timeout=20)
            took = time.monotonic() - silent_at
            for rid in rids:
                fin = replies.final[rid]
                assert isinstance(fin, Finished) and fin.num_tokens == 16 and fin.worker_id == "live", fin
                assert fin.attempt == 1  # the takeover replies above the original attempt (fencing)
            assert w.stages.takeover is not None and w.stages.takeover.taken_total == len(rids)
            print(f"takeover answered {len(rids)} requests {took:.2f}s after the ghost fell silent")
            # the ghost leaves the group at last: its partitions come to the live worker, which re-reads
            # them from the (never committed) start and finds every answer: none runs again
            await ghost.stop()

            async def owns_all() -> bool:
                return w._consumer is not None and mine <= w._consumer.assignment()

            await wait_until(owns_all, timeout=10, interval=0.02, message="the live worker never got the ghost's partitions")

            # every re-delivered record of the ghost's is found answered (the takeover's final reply)
            async def settled() -> bool:
                await replies.poll(20)
                return w.metrics.answered_before._value.get() >= len(rids) and not w.stages.ledger.busy()

            await wait_until(settled, timeout=10, interval=0.05, message="re-delivered records not found answered")
            await replies.poll(100)
            assert sorted(f.request_id for f in replies.finals) == sorted(rids)  # one final each
