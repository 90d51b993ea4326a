"""Exact resume after kill -9 with LoRA adapters, over real Kafka (docs/lora.md): two worker
processes with ``--enable-lora`` and no adapter named at start; the requests name run-time
adapters with their folder (``InferenceRequest.lora_path``), so each worker loads an adapter on
its first request for it, and the survivor of a kill -9 loads the victim's adapters when it
re-runs (resumes) its requests. Every stream, sampled at temperature 0.8, equals the same request
run alone on a healthy engine with that adapter, no seq missing or repeated."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

import pytest

from bus import Finished, InferenceRequest, SamplingParams, connect
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from tests.engine_workers.lora.adapters import make_adapter
from tests.engine_workers.worker.test_worker_kafka import (
    assert_exact_streams,
    assigned,
    free_port,
    kafka_url,
    kill_when_streaming,
    new_layout,
    spawn_worker,
    wait_ready,
)
from tests.engine_workers.worker.test_worker_memory import MODEL, Replies, publish
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


async def test_kill9_with_adapters_resumes_exactly(kafka_bootstrap: str, tiny_model_dir: str, tmp_path: Path) -> None:
    folders = {n: str(make_adapter(tiny_model_dir, tmp_path / n, targets, seed=s))
               for n, targets, s in (("a", ["q_proj", "v_proj", "down_proj"], 5), ("b", ["o_proj", "up_proj"], 6))}
    rng = random.Random(3)
    n = 16
    prompts = [tuple(rng.randrange(3, 500) for _ in range(rng.randint(8, 40))) for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(48, 72), temperature=0.8, ignore_eos=True,
                             seed=rng.randrange(2**32)) for _ in range(n)]
    loras = [("a", "b", None)[i % 3] for i in range(n)]
    ref_engine = Engine(EngineConfig(model=tiny_model_dir, max_num_seqs=8, num_threads=1, kv_cache_bytes=4 << 20,
                                     max_model_len=512, enable_lora=True, lora_modules=tuple(folders.items()),
                                     max_loras=2))
    ref = ref_engine.generate(prompts, params, loras=loras)
    layout = new_layout(4)
    async with connect(kafka_url(kafka_bootstrap)) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test", 1)])
        ports = {w: free_port() for w in ("wa", "wb")}
        procs = {w: spawn_worker(kafka_bootstrap, Path(tiny_model_dir), layout, w, tmp_path / f"{w}.log", ports[w], 4,
                                 extra=("--enable-lora", "--max-loras", "2")) for w in ports}
        try:
            for p in procs.values():
                await wait_ready(p)
            await wait_until(lambda: asyncio.to_thread(lambda: all(assigned(port) for port in ports.values())),
                             timeout=30, interval=0.1, message="both workers holding partitions")
            replies = Replies(bus, layout.reply_topic("test"))
            await replies.consumer.start()
            reqs = [InferenceRequest(f"l{i}", MODEL, p, sp, layout.reply_topic("test"), enqueued_at=time.time(),
                                     lora=lo, lora_path=folders[lo] if lo is not None else None)
                    for i, (p, sp, lo) in enumerate(zip(prompts, params, loras))]
            for r in reqs:
                await publish(bus, layout, r)
            # killed on an adapter request in hand (streamed, far from its end): only those are offered
            victim, chosen = await kill_when_streaming(
                replies, procs, {r.request_id: r.sampling.max_tokens for r in reqs if r.lora is not None},
                after=4, margin=8)
            await replies.wait([r.request_id for r in reqs], 150)
            for r, expected in zip(reqs, ref):
                fin = replies.final[r.request_id]
                assert isinstance(fin, Finished) and fin.num_tokens == len(expected.token_ids), (r.lora, fin)
            assert_exact_streams(replies, reqs, ref)
            survivor = next(w for w in procs if w != victim)
            assert replies.final[chosen].worker_id == survivor  # an adapter request resumed elsewhere
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                p.wait(10)
                if p.stdout is not None:
                    p.stdout.close()
