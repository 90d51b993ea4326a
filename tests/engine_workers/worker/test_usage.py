"""Per-tenant usage: counters labelled by tenant and one UsageRecord per finished request on
``<ns>.usage`` (engine_workers/worker/health/usage.py)."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from bus import Finished, InferenceRequest, MemoryBus, SamplingParams, TopicLayout, UsageRecord, connect, decode, encode
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.engine_workers.worker.test_worker_memory import (  # noqa: F401  (fixtures)
    MODEL,
    Replies,
    layout,
    make_engine,
    publish,
    tiny_dir,
)
from tests.waiting import wait_until

SYSTEM = tuple(range(10, 42))  # 32 tokens: two full blocks shared by each tenant's requests


def _reqs(layout: TopicLayout) -> list[InferenceRequest]:
    out = []
    for i in range(10):
        tenant = "acme" if i % 3 else "globex"
        out.append(InferenceRequest(f"u{i}", MODEL, SYSTEM + (50 + i, 60 + i), SamplingParams(
            max_tokens=3 + i % 4, temperature=0.0, ignore_eos=True), layout.reply_topic("test"), tenant=tenant,
            tier=i % 3, enqueued_at=time.time(), cache_salt=f"tenant:{tenant}"))
    return out


def _sums(items: list[tuple[str, int, int, int]]) -> dict[str, tuple[int, int, int]]:
    acc: dict[str, Counter] = {}
    for tenant, p, c, k in items:
        acc.setdefault(tenant, Counter()).update(p=p, c=c, k=k)
    return {t: (v["p"], v["c"], v["k"]) for t, v in acc.items()}


def _counter(w: Worker, name: str, tenant: str) -> float:
    v = w.metrics.registry.get_sample_value(f"lockgate:{name}_total", {"model": MODEL, "tenant": tenant})
    return v or 0.0


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_usage_records_of_two_tenants_sum_to_the_replies_usage(kafka_bootstrap: str, tiny_dir: Path) -> None:
    layout = TopicLayout(namespace=f"t{uuid.uuid4().hex[:10]}", partitions=2)
    url = f"kafka://{kafka_bootstrap}?linger_ms=1&fetch_max_wait_ms=50"
    async with connect(url) as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test", 1)])
        assert layout.usage_topic in await bus.list_topics()  # created with the model's topics
        async with Worker(WorkerConfig(MODEL, layout=layout), bus, make_engine(tiny_dir, max_num_seqs=2)) as w:
            replies = Replies(bus, layout.reply_topic("test"))
            await replies.consumer.start()
            usage = bus.consumer([layout.usage_topic], start_from="earliest")
            await usage.start()
            reqs = _reqs(layout)
            for r in reqs:
                await publish(bus, layout, r)
            await replies.wait([r.request_id for r in reqs], timeout=60)
            records: dict[str, UsageRecord] = {}

            async def all_recorded() -> bool:
                for rec in await usage.getmany(timeout_ms=200):
                    msg = decode(rec.value)
                    assert isinstance(msg, UsageRecord) and rec.key == msg.tenant.encode()
                    records[msg.request_id] = msg
                return len(records) == len(reqs)

            await wait_until(all_recorded, timeout=30, interval=0, message=lambda: f"usage records: {sorted(records)}")
            await usage.stop()
            by_tenant = {r.request_id: r.tenant for r in reqs}
            finals = {rid: f for rid, f in replies.final.items() if isinstance(f, Finished)}
            assert len(finals) == len(reqs)
            from_replies = _sums([(by_tenant[rid], f.usage.prompt_tokens, f.usage.completion_tokens,
                                   f.usage.cached_tokens) for rid, f in finals.items()])
            from_log = _sums([(u.tenant, u.prompt_tokens, u.completion_tokens, u.cached_tokens)
                              for u in records.values()])
            assert from_log == from_replies and set(from_log) == {"acme", "globex"}
            assert sum(k for _, _, k in from_log.values()) > 0  # the shared system prompt was cached
            for u in records.values():
                assert u.model == MODEL and u.finish_reason == "length" and u.worker_id == w.config.worker_id
                assert u.tier == int(u.request_id[1:]) % 3 and abs(u.finished_at - time.time()) < 60
            for tenant, (p, c, k) in from_replies.items():
                assert (_counter(w, "tenant_prompt_tokens", tenant), _counter(w, "tenant_completion_tokens", tenant),
                        _counter(w, "tenant_cached_tokens", tenant)) == (p, c, k)


class FailingUsageBus(MemoryBus):
    """A memory bus whose usage topic refuses every record."""

    async def send(self, topic, value, key=None, headers=(), partition=None):  # type: ignore[no-untyped-def]
        if topic.endswith(".usage"):
            raise ConnectionError("usage topic unavailable")
        return await super().send(topic, value, key=key, headers=headers, partition=partition)


async def test_a_failing_usage_topic_delays_no_reply_and_is_counted(tiny_dir: Path, layout: TopicLayout) -> None:
    async with FailingUsageBus() as bus, Worker(WorkerConfig(MODEL, layout=layout, commit_interval_s=0), bus,
                                                 make_engine(tiny_dir)) as w:
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        reqs = _reqs(layout)[:4]
        for r in reqs:
            await bus.send(layout.request_topic(MODEL, r.tier), encode(r), key=r.request_id.encode())
        await replies.wait([r.request_id for r in reqs], timeout=30)
        await wait_until(lambda: w.stages.way_back.usage.idle(), timeout=10, message="usage sends given up")
        assert w.metrics.registry.get_sample_value("lockgate:usage_send_failures_total") == len(reqs)
        assert _counter(w, "tenant_prompt_tokens", "acme") > 0  # the counters still count
        # the worker keeps serving and committing
        r = _reqs(layout)[5]
        await publish(bus, layout, r)
        await replies.wait([r.request_id], timeout=30)
