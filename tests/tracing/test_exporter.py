"""The bounded OTLP exporter against a real HTTP receiver on 127.0.0.1 (tests/tracing/receiver.py):
batches, flush on stop, a full queue drops and counts, a dead or stuck receiver costs spans only."""

from __future__ import annotations

import asyncio

import pytest

from tests.tracing.receiver import Receiver, dead_endpoint, receiving
from tests.waiting import wait_until
from tracing import OtlpExporter, SpanKind, SpanRecord, Tracer, traces_url

pytestmark = pytest.mark.timeout(60)

RESOURCE = {"service.name": "test-svc"}


def span(i: int) -> SpanRecord:
    return SpanRecord("ab" * 16, f"{i + 1:016x}", "", f"s{i}", SpanKind.INTERNAL, 1_000 + i, 2_000 + i, (("i", i),))


def tasks_named(name: str) -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name() == name and not t.done()]


@pytest.fixture
def receiver():
    with receiving() as r:
        yield r


def test_traces_url_appends_the_signal_path_and_checks_the_scheme() -> None:
    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url(" https://otel.example:4318/ ") == "https://otel.example:4318/v1/traces"
    assert traces_url("http://c:4318/prefix") == "http://c:4318/prefix/v1/traces"
    for bad in ("127.0.0.1:4318", "grpc://c:4317", "http://", "http:///", ""):
        with pytest.raises(ValueError, match="not an http:// or https:// URL"):
            traces_url(bad)


async def test_stop_flushes_what_is_queued(receiver: Receiver) -> None:
    ex = OtlpExporter(receiver.url, RESOURCE, interval_s=3600)  # no timer flush: only stop sends
    await ex.start()
    for i in range(5):
        ex.offer(span(i))
    await ex.stop()
    assert receiver.errors == []
    got = receiver.spans()
    assert sorted(s.name for s in got) == [f"s{i}" for i in range(5)]
    assert {s.service for s in got} == {"test-svc"} and got[0].attributes == {"i": 0}
    assert receiver.content_types == ["application/json"]
    assert (ex.exported, ex.dropped, ex.failed_batches) == (5, 0, 0)


async def test_a_full_batch_is_sent_without_waiting_for_the_interval(receiver: Receiver) -> None:
    ex = OtlpExporter(receiver.url, RESOURCE, batch=4, interval_s=3600)
    async with ex:
        for i in range(9):
            ex.offer(span(i))
        await wait_until(lambda: len(receiver.spans()) >= 8, timeout=10)
        assert [len(r.resource_spans[0].scope_spans[0].spans) for r in receiver.requests[:2]] == [4, 4]
    assert len(receiver.spans()) == 9 and ex.exported == 9  # the ninth on stop
    assert receiver.errors == []


async def test_the_interval_sends_a_partial_batch(receiver: Receiver) -> None:
    async with OtlpExporter(receiver.url, RESOURCE, interval_s=0.05) as ex:
        ex.offer(span(0))
        await wait_until(lambda: len(receiver.spans()) == 1, timeout=10)
        assert ex.exported == 1


async def test_a_full_queue_drops_and_counts_and_offer_never_waits(receiver: Receiver) -> None:
    """While the receiver is stuck on a POST, offers keep returning at once; past ``max_queue``
    they are dropped and counted; once it answers, what was queued is sent."""
    receiver.hold.clear()
    ex = OtlpExporter(receiver.url, RESOURCE, max_queue=10, batch=2, interval_s=0.05, timeout_s=20)
    await ex.start()
    try:
        ex.offer(span(0))
        ex.offer(span(1))
        await wait_until(lambda: receiver.in_flight == 1, timeout=10)  # the first batch is in flight, stuck
        for i in range(2, 27):  # 25 more offers: 10 fit, 15 are dropped
            ex.offer(span(i))
        assert ex.dropped == 15
        # the event loop is not held by the stuck POST (it runs on a thread)
        await asyncio.wait_for(asyncio.sleep(0.01), 5)
    finally:
        receiver.hold.set()
        await ex.stop()
    assert ex.exported == 12 and ex.dropped == 15
    assert sorted(int(s.name[1:]) for s in receiver.spans()) == list(range(12))


async def test_a_dead_endpoint_counts_drops_and_never_raises() -> None:
    ex = OtlpExporter(dead_endpoint(), RESOURCE, batch=2, interval_s=0.05, timeout_s=2)
    tracer = Tracer(ex.offer)
    await ex.start()
    for i in range(3):
        tracer.start(f"s{i}").end()
    await wait_until(lambda: ex.failed_batches >= 1, timeout=10)
    tracer.start("late").end()
    await ex.stop()
    assert ex.exported == 0 and ex.dropped == 4  # every span, none retried without bound


async def test_a_refusing_receiver_counts_as_a_failure(receiver: Receiver) -> None:
    receiver.status = 500
    ex = OtlpExporter(receiver.url, RESOURCE, interval_s=3600)
    await ex.start()
    ex.offer(span(0))
    await ex.stop()
    assert (ex.exported, ex.dropped, ex.failed_batches) == (0, 1, 1)
    assert len(receiver.bodies) == 1 and receiver.errors == []  # it arrived and parsed, but was refused


async def test_a_stuck_receiver_delays_stop_by_a_bounded_time(receiver: Receiver) -> None:
    receiver.hold.clear()
    ex = OtlpExporter(receiver.url, RESOURCE, interval_s=3600, timeout_s=0.5)
    await ex.start()
    ex.offer(span(0))
    await asyncio.wait_for(ex.stop(), 10)  # the POST times out after timeout_s; stop waits at most 2x that
    assert ex.exported == 0 and ex.dropped == 1
    assert tasks_named("otlp-exporter") == []


async def test_the_task_is_owned_start_and_stop_are_idempotent(receiver: Receiver) -> None:
    ex = OtlpExporter(receiver.url, RESOURCE)
    await ex.stop()  # never started: nothing to do
    await ex.start()
    await ex.start()
    assert len(tasks_named("otlp-exporter")) == 1
    await ex.stop()
    await ex.stop()
    assert tasks_named("otlp-exporter") == []
    async with ex:  # restartable
        ex.offer(span(0))
    assert ex.exported == 1 and tasks_named("otlp-exporter") == []


async def test_a_span_that_does_not_encode_is_dropped_and_the_exporter_lives_on(receiver: Receiver) -> None:
    ex = OtlpExporter(receiver.url, RESOURCE, interval_s=3600, batch=1)
    await ex.start()
    bad = SpanRecord("ab" * 16, "f" * 16, "", "bad \ud800", SpanKind.INTERNAL, 1, 2)  # a lone surrogate: not UTF-8
    ex.offer(bad)
    await wait_until(lambda: ex.dropped == 1, timeout=10)
    ex.offer(span(0))  # the task is still running: the next span goes out
    await wait_until(lambda: ex.exported == 1, timeout=10)
    assert tasks_named("otlp-exporter")
    await ex.stop()
    assert [s.name for s in receiver.spans()] == ["s0"] and receiver.errors == []


async def test_a_cancelled_stop_does_not_orphan_the_task(receiver: Receiver) -> None:
    receiver.hold.clear()  # a stuck collector: the flush in stop() waits
    ex = OtlpExporter(receiver.url, RESOURCE, interval_s=3600, timeout_s=5)
    await ex.start()
    ex.offer(span(0))
    stopping = asyncio.create_task(ex.stop())
    await wait_until(lambda: receiver.in_flight == 1, timeout=10)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    receiver.hold.set()
    assert tasks_named("otlp-exporter") == []
