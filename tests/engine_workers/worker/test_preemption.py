"""Preemptive priority, on by default: with every slot, or the whole KV cache, busy with p2 work,
a p0 arrival starts at once (the worst running p2 sequence is preempted by recompute), and the
preempted stream still completes exactly."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from bus import Finished, InferenceRequest, MemoryBus, SamplingParams, TopicLayout
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.engine_workers.worker.test_worker_memory import (  # noqa: F401 - pytest fixtures, used by name
    MODEL,
    Replies,
    layout,
    make_engine,
    publish,
    tiny_dir,
)
from tests.waiting import wait_until

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny model: layers * (K, V) * block * kv_heads * head_dim * fp32


def _req(rid: str, layout: TopicLayout, tier: int, n: int, seed: int,
         prompt: tuple[int, ...] = (11, 12, 13, 14, 15)) -> InferenceRequest:
    return InferenceRequest(rid, MODEL, prompt,
                            SamplingParams(max_tokens=n, temperature=0.8, seed=seed, ignore_eos=True),
                            layout.reply_topic("test"), tier=tier, enqueued_at=time.time())


async def test_a_p0_arrival_preempts_p2_work_and_every_stream_stays_exact(tiny_dir: Path, layout: TopicLayout) -> None:
    p2 = [_req(f"bg{i}", layout, 2, 120, seed=40 + i) for i in range(2)]
    p0 = _req("urgent", layout, 0, 6, seed=7)
    ref = {r.request_id: out.token_ids for r, out in zip(
        p2 + [p0], make_engine(tiny_dir).generate([r.prompt_token_ids for r in p2 + [p0]],
                                                  [r.sampling for r in p2 + [p0]]))}
    engine = Engine(EngineConfig(model=str(tiny_dir), max_num_seqs=2, num_threads=1, kv_cache_bytes=4 << 20,
                                 max_model_len=512))  # priority preemption: the default
    async with MemoryBus() as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test")])
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        # 10 ms a step (the step loop's pacing, not synchronisation): the p2 work takes >1 s
        async with Worker(WorkerConfig(MODEL, layout=layout), bus, engine, before_step=lambda: time.sleep(0.01)):
            for r in p2:
                await publish(bus, layout, r)

            async def both_streaming() -> bool:
                await replies.poll(20)
                return all(len(replies.tokens.get(r.request_id, {})) >= 5 for r in p2)

            await wait_until(both_streaming, timeout=30, interval=0, message="both p2 requests streaming")
            await publish(bus, layout, p0)
            await replies.wait(["urgent"], 30)
            # p0 ran while the p2 work was still under way: neither had finished
            assert not any(r.request_id in replies.final for r in p2), "p0 waited for a p2 request to finish"
            await replies.wait([r.request_id for r in p2], 60)
            for rid, expected in ref.items():
                assert replies.stream(rid) == list(expected), rid  # exact, the preempted one too
                fin = replies.final[rid]
                assert isinstance(fin, Finished) and fin.num_tokens == len(expected)
            assert engine.scheduler.num_preemptions >= 1


async def test_a_p0_arrival_preempts_p2_work_that_fills_the_kv_cache(tiny_dir: Path, layout: TopicLayout) -> None:
    """Slots free (8), KV cache full: two p2 requests of 68 + 12 tokens take 5 of the 10 blocks each
    from their prefill on. The worker sends the p0 request into the full engine (it would preempt)
    and the engine gives it the newer p2 request's blocks; all three streams exact."""
    p2 = [_req(f"bg{i}", layout, 2, 12, seed=60 + i, prompt=(30 + i, *range(40, 107))) for i in range(2)]
    p0 = _req("urgent", layout, 0, 4, seed=9, prompt=(21, 22, 23, 24) * 5)
    ref = {r.request_id: out.token_ids for r, out in zip(
        p2 + [p0], make_engine(tiny_dir).generate([r.prompt_token_ids for r in p2 + [p0]],
                                                  [r.sampling for r in p2 + [p0]]))}
    engine = Engine(EngineConfig(model=str(tiny_dir), max_num_seqs=8, num_threads=1, kv_cache_bytes=10 * BLOCK_BYTES,
                                 max_model_len=128))
    assert engine.kv.num_blocks == 10
    armed = threading.Event()

    def pace() -> None:
        # 10 ms a step; 200 ms while the p0 request is on its way (the p2 work has ~10 steps left:
        # it must still hold the cache when the p0 request gets there, on a busy machine too)
        slow = armed.is_set() and not any(s.tier == 0 for s in (*engine.scheduler.running, *engine.scheduler.waiting()))
        time.sleep(0.2 if slow else 0.01)

    async with MemoryBus() as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test")])
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        async with Worker(WorkerConfig(MODEL, layout=layout), bus, engine, before_step=pace):
            for r in p2:
                await publish(bus, layout, r)

            async def both_streaming() -> bool:
                await replies.poll(20)
                return all(len(replies.tokens.get(r.request_id, {})) >= 1 for r in p2)

            await wait_until(both_streaming, timeout=30, interval=0, message="both p2 requests streaming")
            armed.set()
            await publish(bus, layout, p0)
            await replies.wait(["urgent"], 30)
            assert not any(r.request_id in replies.final for r in p2), "p0 waited for a p2 request to finish"
            await replies.wait([r.request_id for r in p2], 60)
            for rid, expected in ref.items():
                assert replies.stream(rid) == list(expected), rid
            assert engine.scheduler.num_preemptions == 1
