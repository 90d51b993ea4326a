"""kill -9 mid-speculation on a real Kafka broker: two workers speculating (a draft model: the tiny
target as its own draft, so nearly every step verifies several proposals), one killed while it
streams; every stream equals plain decoding's (greedy and seeded sampling), with no seq missing
or repeated, and the survivor resumes what the victim had published."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from bus import Finished, InferenceRequest, SamplingParams, connect
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
from tests.engine_workers.worker.test_worker_memory import (
    MODEL,
    Replies,
    make_engine,
    publish,
    tiny_dir,  # noqa: F401 - a fixture
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka]


def spec_counter(port: int, name: str) -> float:
    """A labelled counter of the worker's /metrics (summed over its labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, flags=re.M))


@pytest.mark.timeout(400)  # two worker starts (each loads a draft too) on a loaded 2-core machine
async def test_kill9_mid_speculation_resumes_exactly(kafka_bootstrap: str, tiny_dir: Path, tmp_path: Path) -> None:
    layout = new_layout()
    rng = random.Random(5)
    n = 12
    prompts = [tuple(rng.randrange(3, 500) for _ in range(rng.randint(8, 40))) for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(56, 80), ignore_eos=True,
                             temperature=0.0 if i % 3 == 0 else 0.8, seed=rng.randrange(2**32)) for i in range(n)]
    ref = make_engine(tiny_dir, max_num_seqs=8).generate(prompts, list(params))
    spec = f'{{"method": "draft_model", "model": "{tiny_dir}", "num_speculative_tokens": 3}}'
    async with connect(kafka_url(kafka_bootstrap)) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test", 1)])
        ports = {w: free_port() for w in ("wa", "wb")}
        procs = {w: spawn_worker(kafka_bootstrap, tiny_dir, layout, w, tmp_path / f"{w}.log", ports[w], 3,
                                 extra=("--speculative-config", spec)) for w in ("wa", "wb")}
        try:
            for p in procs.values():
                await wait_ready(p)
            await wait_until(lambda: asyncio.to_thread(lambda: all(assigned(port) for port in ports.values())),
                             timeout=60, interval=0.1, message="both workers holding partitions")
            replies = Replies(bus, layout.reply_topic("test"))
            await replies.consumer.start()
            reqs = [InferenceRequest(f"k{i}", MODEL, p, sp, layout.reply_topic("test"), tier=1, enqueued_at=time.time())
                    for i, (p, sp) in enumerate(zip(prompts, params))]
            for r in reqs:
                await publish(bus, layout, r)
            victim, _ = await kill_when_streaming(replies, procs, {r.request_id: r.sampling.max_tokens for r in reqs},
                                                  timeout=180, margin=16)
            await replies.wait([r.request_id for r in reqs], 180)
            survivor = next(w for w in procs if w != victim)
            for r, expected in zip(reqs, ref):
                fin = replies.final[r.request_id]
                assert isinstance(fin, Finished) and fin.num_tokens == len(expected.token_ids), fin
            assert_exact_streams(replies, reqs, ref)
            # the survivor speculated (drafts verified, tokens accepted) and resumed the victim's streams
            assert spec_counter(ports[survivor], "lockgate:spec_decode_num_accepted_tokens_total") > 0
            published = {c.request_id for c in replies.chunks if c.worker_id == victim}
            assert any(replies.final[rid].worker_id == survivor for rid in published)
            procs[survivor].send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(procs[survivor].wait, 30) == 0
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait(10)
                if p.stdout is not None:
                    p.stdout.close()
