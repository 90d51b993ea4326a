"""A worker serving LoRA adapters over the memory bus: a request's ``lora`` reaches the engine
(replies equal the engine's own output for that adapter), heartbeats list the adapters, usage
records and the ``lora_requests_info`` gauge name them, and an adapter the worker lacks is an
``invalid_request`` error, never the base model's output."""

from __future__ import annotations

import time

import pytest

from bus import Error, Finished, InferenceRequest, MemoryBus, SamplingParams, TopicLayout, UsageRecord, WorkerStatus, decode
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.engine_workers.lora.adapters import make_adapter
from tests.engine_workers.worker.test_worker_memory import MODEL, Replies, layout, publish  # noqa: F401  (fixture)
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir, tmp_path_factory) -> Engine:
    root = tmp_path_factory.mktemp("worker-loras")
    a = make_adapter(tiny_model_dir, root / "a", ["q_proj", "v_proj", "down_proj"], seed=1)
    b = make_adapter(tiny_model_dir, root / "b", ["o_proj", "gate_proj", "up_proj"], seed=2)
    return Engine(EngineConfig(model=tiny_model_dir, max_num_seqs=4, num_threads=1, kv_cache_bytes=4 << 20,
                               max_model_len=512, enable_lora=True, lora_modules=(("a", str(a)), ("b", str(b))),
                               max_loras=2))


async def test_worker_serves_each_request_with_its_adapter(lora_engine: Engine, layout: TopicLayout) -> None:
    prompts = [tuple(range(5 + i, 30 + i)) for i in range(4)]
    loras = ["a", None, "b", "a"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = lora_engine.generate(prompts, params, loras=loras)
    assert len({tuple(r.token_ids) for r in ref[:3]}) == 3  # the adapters change the output
    async with MemoryBus() as bus, Worker(WorkerConfig(MODEL, layout=layout, heartbeat_s=0.05), bus, lora_engine) as w:
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        status = bus.consumer([layout.status_topic], start_from="earliest")
        usage = bus.consumer([layout.usage_topic], start_from="earliest")
        await status.start()
        await usage.start()
        reqs = [InferenceRequest(f"l{i}", MODEL, p, params, layout.reply_topic("test"), enqueued_at=time.time(), lora=lo)
                for i, (p, lo) in enumerate(zip(prompts, loras))]
        bad = InferenceRequest("nope", MODEL, prompts[0], params, layout.reply_topic("test"), enqueued_at=time.time(),
                               lora="missing")
        for r in [*reqs, bad]:
            await publish(bus, layout, r)
        await replies.wait([r.request_id for r in [*reqs, bad]])
        for r, want in zip(reqs, ref):
            assert replies.stream(r.request_id) == list(want.token_ids), r.lora
            assert isinstance(replies.final[r.request_id], Finished)
        err = replies.final["nope"]
        assert isinstance(err, Error) and err.code == "invalid_request" and "missing" in err.message
        assert replies.stream("nope") == []

        beats: list = []

        async def beat() -> bool:
            beats.extend(decode(r.value) for r in await status.getmany(timeout_ms=100))
            return any(isinstance(b, WorkerStatus) for b in beats)

        await wait_until(beat)
        assert [b for b in beats if isinstance(b, WorkerStatus)][-1].loras == ("a", "b")
        records: dict[str, UsageRecord] = {}

        async def recorded() -> bool:
            for rec in await usage.getmany(timeout_ms=100):
                msg = decode(rec.value)
                assert isinstance(msg, UsageRecord)
                records[msg.request_id] = msg
            return len(records) == len(reqs)

        await wait_until(recorded)
        assert {rid: rec.lora for rid, rec in records.items()} == {r.request_id: r.lora for r in reqs}
        m = w.render_metrics().decode()
        assert 'lockgate:lora_requests_info{max_lora="2",model="tiny"' in m
        await status.stop()
        await usage.stop()
