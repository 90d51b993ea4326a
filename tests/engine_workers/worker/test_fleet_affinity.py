"""Prefix-affine partitioning across a fleet: 3 workers (in-process, memory bus, tiny model), 8
shared system prompts, 200 requests. The fleet's prefix-hit rate stays close to one worker's."""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

from bus import ChatMessage, Finished, InferenceRequest, MemoryBus, SamplingParams, TopicLayout, encode
from edge.admission.affinity import Placement, PrefixAffinity
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.engine_workers.worker.test_worker_memory import (  # noqa: F401  (fixtures)
    MODEL,
    Replies,
    layout,
    make_engine,
    tiny_dir,
)
from tests.waiting import wait_until

PROMPTS, REQUESTS, WAVE = 8, 200, 10


def _traffic(layout: TopicLayout) -> list[InferenceRequest]:
    rng = random.Random(7)
    systems = [tuple(rng.randrange(3, 250) for _ in range(48)) for _ in range(PROMPTS)]  # 3 blocks each
    out = []
    for i in range(REQUESTS):
        s = rng.randrange(PROMPTS)
        user = tuple(rng.randrange(3, 250) for _ in range(rng.randrange(4, 12)))
        out.append(InferenceRequest(
            f"q{i}", MODEL, systems[s] + user, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
            layout.reply_topic("test"), tenant="acme", tier=1, enqueued_at=time.time(), cache_salt="tenant:acme",
            messages=(ChatMessage("system", f"system prompt {s}"), ChatMessage("user", str(user)))))
    return out


async def _hit_rate(tiny_dir: Path, layout: TopicLayout, workers: int, affinity: bool) -> float:
    """Prompt tokens found cached / prompt tokens, over the traffic published in waves of 10."""
    async with MemoryBus() as bus, contextlib.AsyncExitStack() as stack:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test")])
        fleet = [await stack.enter_async_context(Worker(WorkerConfig(MODEL, layout=layout, worker_id=f"w{k}"), bus,
                                                        make_engine(tiny_dir))) for k in range(workers)]
        topic = layout.request_topic(MODEL, 1)

        def settled() -> bool:
            owned = [tp for w in fleet if w._consumer for tp in w._consumer.assignment() if tp.topic == topic]
            return all(w.ready() for w in fleet) and len(owned) == len(set(owned)) == layout.partitions

        await wait_until(settled, timeout=30, message="the group's partitions shared by every worker")
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        place = Placement(bus, PrefixAffinity() if affinity else None)
        reqs = _traffic(layout)
        for i in range(0, len(reqs), WAVE):
            wave = reqs[i:i + WAVE]
            for r in wave:
                key, part = await place.place(topic, r)
                await bus.send(topic, encode(r), key=key, partition=part)
            await replies.wait([r.request_id for r in wave], timeout=60)
        fins = [replies.final[r.request_id] for r in reqs]
        assert all(isinstance(f, Finished) for f in fins)
        if workers > 1:
            assert all(any(f.worker_id == w.config.worker_id for f in fins) for w in fleet)  # all took part
        prompt = sum(f.usage.prompt_tokens for f in fins)  # type: ignore[union-attr]
        return sum(f.usage.cached_tokens for f in fins) / prompt  # type: ignore[union-attr]


async def test_fleet_prefix_hit_rate_is_at_least_80_percent_of_one_workers(tiny_dir: Path, layout: TopicLayout) -> None:
    one = await _hit_rate(tiny_dir, layout, 1, affinity=True)
    fleet = await _hit_rate(tiny_dir, TopicLayout(namespace=layout.namespace + "f", partitions=6), 3, affinity=True)
    spread = await _hit_rate(tiny_dir, TopicLayout(namespace=layout.namespace + "s", partitions=6), 3, affinity=False)
    print(f"prefix-hit rate: one worker {one:.3f}, fleet with affinity {fleet:.3f}, by request id {spread:.3f}")
    assert one > 0.5
    assert fleet >= 0.8 * one, (fleet, one)
    assert fleet > spread  # keyed by request id, each prompt's blocks are computed on every worker
