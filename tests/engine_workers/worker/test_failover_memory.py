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
from engine_workers.worker.failover.detector import owner
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


async def test_a_taker_dying_in_turn_hands_its_takeovers_on_at_once(tiny_dir, layout: TopicLayout) -> None:
    """Two workers dying one after the other: ghost ``v`` (holding partitions) falls silent; the
    owner rule gives some of its requests to ghost ``s``, which claims them and falls silent too
    before answering. The live worker takes those over as soon as ``s`` is presumed dead, not when
    the group reassigns ``v``'s partitions (``v`` never leaves the group here)."""
    async with MemoryBus() as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test", 1)])
        cfg = WorkerConfig(MODEL, layout=layout, worker_id="live", heartbeat_s=0.05, commit_interval_s=0)
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
            keyed = [f"r{i}" for i in range(400) if partition_for_key(f"r{i}".encode(), layout.partitions) in held]
            to_s = [rid for rid in keyed if owner(rid, ["live", "s"]) == "s"][:2]
            to_live = [rid for rid in keyed if owner(rid, ["live", "s"]) == "live"][:2]
            assert len(to_s) == len(to_live) == 2
            since = int(time.time() * 1000) - 1000
            for rid in to_s + to_live:
                await bus.send(topic, encode(req(rid, layout, max_tokens=16)), key=rid.encode())
            assert w.stages.takeover is not None
            numerics = w.stages.takeover.config.numerics
            holds = tuple(PartitionHold(tp.topic, tp.partition, since) for tp in sorted(mine))
            replies = Replies(bus, layout.reply_topic("test"))
            await replies.consumer.start()

            async def beat(wid: str, **kw) -> None:
                await bus.send(layout.status_topic, encode(WorkerStatus(wid, MODEL, time.time(), numerics=numerics, **kw)))

            for _ in range(4):  # both ghosts steady
                await beat("v", holds=holds)
                await beat("s")
                await asyncio.sleep(0.05)

            # v falls silent; s lives on, claiming its share, until the live worker answered its own
            async def live_share_answered() -> bool:
                await beat("s", taken=tuple(to_s))
                await replies.poll(20)
                return set(to_live) <= set(replies.final)

            await wait_until(live_share_answered, timeout=20, interval=0.05, message="the live worker's share not answered")
            assert not set(to_s) & set(replies.final)  # s's share waited for s
            silent_at = time.monotonic()  # s falls silent: its claims die with it
            await replies.wait(to_s, timeout=8)  # far under any group timeout; v never leaves the group
            print(f"s's takeovers answered {time.monotonic() - silent_at:.2f}s after s fell silent")
            for rid in to_s + to_live:
                fin = replies.final[rid]
                assert isinstance(fin, Finished) and fin.num_tokens == 16 and fin.worker_id == "live", fin
            assert w.stages.takeover.taken_total == 4
            await ghost.stop()
