"""The end-to-end trace (tests/tracing/test_trace_kafka.py) against the real OpenTelemetry
Collector instead of the stdlib receiver: the collector accepts lockgate's OTLP/HTTP JSON and
shows one trace across edge -> Kafka -> worker. Opt-in (``make otel-check``: it builds the
collector with Go, minutes when cold); skipped without ``LOCKGATE_OTELCOL``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.engine_workers.worker.test_worker_kafka import kafka_url
from tests.engine_workers.worker.test_worker_memory import tiny_dir  # noqa: F401 - pytest fixture, used by name
from tests.tracing.collector import binary, collector, parse_debug_output
from tests.tracing.receiver import GotSpan
from tests.tracing.test_trace_kafka import MAX_TOKENS, chat, check_trace, complete, traced_platform
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.otelcol, pytest.mark.timeout(180)]


def test_the_debug_output_reader() -> None:
    """The reader of the collector's debug lines, on a sample of its output (v0.165.0)."""
    sample = """2026-12-07T09:23:23.173Z\tinfo\tResourceSpans #0
Resource SchemaURL:
Resource attributes:
     -> service.name: Str(svc)
ScopeSpans #0
ScopeSpans SchemaURL:
InstrumentationScope lockgate 1.0
Span #0
    Trace ID       : 4bf92f3577b34da6a3ce929d0e0e4736
    Parent ID      :
    ID             : c14f99de8210bcc8
    Name           : a b
    Kind           : Server
    Start time     : 2026-12-07 09:23:23.17057 +0000 UTC
    End time       : 2026-12-07 09:23:24.170577045 +0000 UTC
    Status code    : Error
    Status message : boom: x
    DroppedAttributesCount: 0
Attributes:
     -> x: Int(1)
     -> y: Bool(true)
     -> s: Str(q: r)
\t{"resource": {}}
"""
    (s,) = parse_debug_output(sample)
    assert (s.service, s.trace_id, s.parent_id, s.span_id, s.name, s.kind) == (
        "svc", "4bf92f3577b34da6a3ce929d0e0e4736", "", "c14f99de8210bcc8", "a b", 2)
    assert s.end_ns - s.start_ns == 1_000_007_045 and (s.status_code, s.status_message) == (2, "boom: x")
    assert s.attributes == {"x": 1, "y": True, "s": "q: r"}


@pytest.fixture
def otelcol(tmp_path: Path):
    path = binary()
    if path is None:
        pytest.skip("needs the OpenTelemetry Collector: run `make otel-check` (LOCKGATE_OTELCOL unset)")
    with collector(path, tmp_path) as (endpoint, log):
        yield endpoint, log


async def test_one_trace_through_the_real_collector(otelcol, kafka_bootstrap: str, tiny_dir: Path) -> None:
    endpoint, log = otelcol
    trace, parent = os.urandom(16).hex(), os.urandom(8).hex()

    def spans() -> list[GotSpan]:
        return [s for s in parse_debug_output(log.read_text(errors="replace")) if s.trace_id == trace]

    async with traced_platform(kafka_url(kafka_bootstrap), tiny_dir, endpoint) as (edge, edge_ex, worker_ex):
        r = await chat(edge, {"traceparent": f"00-{trace}-{parent}-01"})
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
        await wait_until(lambda: complete(spans()), timeout=30,
                         message=lambda: f"collector output so far: {log.read_text(errors='replace')[-3000:]}")
        check_trace(spans(), parent, "openai", r["usage"]["prompt_tokens"])
    assert edge_ex.failed_batches == 0 and worker_ex.failed_batches == 0 and edge_ex.dropped == worker_ex.dropped == 0
