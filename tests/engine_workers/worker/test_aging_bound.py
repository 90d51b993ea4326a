"""Bounded aging: a backlog of old low-tier records cannot jump ahead of fresh p0 requests by more
than the documented bound (docs/worker.md, Intake and aging): aging counts from the enqueue time
but at most one aging period before the worker fetched the record."""

from __future__ import annotations

import time
from pathlib import Path

from bus import InferenceRequest, MemoryBus, SamplingParams, TopicLayout
from engine_workers.worker.actor import Worker, WorkerConfig
from engine_workers.worker.intake.queue import aging_start
from tests.engine_workers.worker.test_worker_memory import (  # noqa: F401 - pytest fixtures, used by name
    MODEL,
    Replies,
    layout,
    make_engine,
    publish,
    record_submissions,
    tiny_dir,
)
from tests.waiting import wait_until


def test_aging_counts_from_at_most_one_period_before_the_fetch() -> None:
    assert aging_start(100.0, 101.0, 2.0, 1.0) == 100.0  # a fresh record: its enqueue time
    assert aging_start(10.0, 101.0, 2.0, 1.0) == 99.0  # an old one: one period of credit
    assert aging_start(150.0, 101.0, 2.0, 1.0) == 101.0  # a producer clock ahead: never after the fetch
    assert aging_start(10.0, 101.0, 2.0, None) == 10.0  # no cap (--age-credit-periods none): all of its age


def _req(rid: str, layout: TopicLayout, tier: int, enqueued_at: float) -> InferenceRequest:
    return InferenceRequest(rid, MODEL, (5, 6, 7, 8), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                            layout.reply_topic("test"), tier=tier, enqueued_at=enqueued_at)


async def test_a_p2_backlog_older_than_2p_does_not_hold_back_fresh_p0(tiny_dir: Path, layout: TopicLayout) -> None:
    backlog, prefetch, slots = 500, 4, 1
    async with MemoryBus() as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test")])
        old = time.time() - 60.0  # far older than 2 aging periods (P = 2 s)
        for i in range(backlog):
            await publish(bus, layout, _req(f"b{i}", layout, 2, old))
        cfg = WorkerConfig(MODEL, layout=layout, prefetch_per_tier=prefetch, age_credit_periods=1.0)
        async with Worker(cfg, bus, make_engine(tiny_dir, max_num_seqs=slots)) as w:
            submitted = record_submissions(w)
            await wait_until(lambda: len(submitted) >= 20, timeout=60, message="the backlog being served")
            passed = []
            for k in range(3):
                at = len(submitted)
                await publish(bus, layout, _req(f"p{k}", layout, 0, time.time()))
                await wait_until(lambda k=k: f"p{k}" in submitted, timeout=60,
                                 message=f"p{k} admitted")
                idx = submitted.index(f"p{k}")
                passed.append(sum(1 for e in submitted[at:idx] if e.startswith("b")))
            remaining = backlog - sum(1 for e in submitted if e.startswith("b"))
        # each fresh p0 was passed only by p2 records already held in the intake (at most
        # prefetch_per_tier + free slots of them), never by the rest of the backlog
        assert all(n <= prefetch + slots for n in passed), passed
        assert remaining > 100, "the backlog must still be there for the test to mean something"
