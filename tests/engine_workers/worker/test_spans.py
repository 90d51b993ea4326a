"""The worker's spans of one request (engine_workers/worker/spans.py), driven directly: the phases
from the engine's stamps, a request answered without running, an error reply, one end per span."""

from __future__ import annotations

import time

from bus import Error, ErrorCode, Finished, InferenceRequest, Record, SamplingParams, TopicPartition, Usage
from engine_workers.engine.outputs import RequestOutput
from engine_workers.engine.sequence import SeqTimes
from engine_workers.worker.offsets.ledger import Job
from engine_workers.worker.spans import WorkerSpans
from tracing import SpanContext, SpanKind, SpanRecord, Tracer, to_headers

PARENT = SpanContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")


def job_and_record(headers: tuple[tuple[str, bytes], ...] = to_headers(PARENT)) -> tuple[Job, Record]:
    req = InferenceRequest("r-1", "tiny", (1, 2, 3), SamplingParams(max_tokens=4), "reply.e", tier=2, attempt=1)
    job = Job("r-1#0", req, TopicPartition("ns.req.tiny.p2", 3), 17, time.time(), 1)
    return job, Record("ns.req.tiny.p2", 3, 17, b"r-1", b"{}", 0, headers)


def spans_of() -> tuple[WorkerSpans, list[SpanRecord]]:
    got: list[SpanRecord] = []
    return WorkerSpans(Tracer(got.append), "w-1"), got


def test_a_finished_request_tiles_its_span_with_the_engine_phases() -> None:
    ws, got = spans_of()
    job, rec = job_and_record()
    ws.begin(job, rec)
    assert job.span is not None
    job.span.start_ns -= 1_000_000_000  # fetched a second ago: before the engine's stamps below
    now = time.monotonic()
    out = RequestOutput("r-1#0", 3, (9,), "x", 0, None, True, "length", 3, 1, 4,
                        SeqTimes(now - 0.3, now - 0.3, now - 0.2, now - 0.1, now))
    job.started = True
    ws.engine_done(job, out)
    fin = Finished("r-1", 1, "length", 4, Usage(3, 4, 1), {}, "w-1")
    ws.closing(job, fin)
    assert [r.name for r in got] == ["queue wait", "prefill", "decode"]  # the worker span is still open
    ws.acked(job)
    ws.acked(job)  # a second ack ends nothing more
    by = {r.name: r for r in got}
    assert [r.name for r in got] == ["queue wait", "prefill", "decode", "reply send", "lockgate.worker"]
    w = by["lockgate.worker"]
    assert (w.trace_id, w.parent_id, w.kind, w.error) == (PARENT.trace_id, PARENT.span_id, SpanKind.CONSUMER, None)
    for name in ("queue wait", "prefill", "decode", "reply send"):
        assert by[name].parent_id == w.span_id and by[name].trace_id == w.trace_id
    qw, pf, dc, rs = by["queue wait"], by["prefill"], by["decode"], by["reply send"]
    assert w.start_ns == qw.start_ns <= qw.end_ns == pf.start_ns <= pf.end_ns == dc.start_ns <= dc.end_ns
    assert dc.end_ns <= rs.start_ns <= rs.end_ns == w.end_ns
    assert abs((pf.end_ns - pf.start_ns) - 100_000_000) < 1_000_000  # 0.1 s of the engine's stamps, in ns
    attrs = dict(w.attributes)
    assert attrs == {"lockgate.request_id": "r-1", "lockgate.worker_id": "w-1", "lockgate.tier": 2, "lockgate.attempt": 1,
                     "messaging.destination.name": "ns.req.tiny.p2", "messaging.destination.partition.id": "3",
                     "messaging.kafka.offset": 17, "gen_ai.request.model": "tiny", "gen_ai.usage.input_tokens": 3,
                     "gen_ai.usage.output_tokens": 4, "gen_ai.response.finish_reasons": "length"}
    assert dict(pf.attributes) == {"gen_ai.usage.input_tokens": 3, "lockgate.cached_tokens": 1}
    assert dict(dc.attributes) == {"gen_ai.usage.output_tokens": 4}


def test_an_error_before_running_only_waited_and_fails_the_span() -> None:
    ws, got = spans_of()
    job, rec = job_and_record()
    ws.begin(job, rec)
    ws.closing(job, Error("r-1", ErrorCode.EXPIRED, "deadline passed in the queue", 1))
    ws.acked(job)
    assert [r.name for r in got] == ["queue wait", "reply send", "lockgate.worker"]
    w = got[-1]
    assert w.error is not None and w.error.startswith("expired: deadline passed")


def test_a_record_without_a_header_starts_a_trace_of_its_own() -> None:
    ws, got = spans_of()
    job, rec = job_and_record(headers=(("traceparent", b"00-bad"),))
    ws.begin(job, rec)
    ws.closing(job, Error("r-1", ErrorCode.INTERNAL, "x", 1))
    ws.acked(job)
    w = got[-1]
    assert w.name == "lockgate.worker" and w.parent_id == "" and w.trace_id != PARENT.trace_id


def test_a_request_that_never_began_a_span_is_ignored() -> None:
    ws, got = spans_of()
    job, _ = job_and_record()  # tracing was off when it was fetched: no span
    ws.closing(job, Error("r-1", ErrorCode.INTERNAL, "x", 1))
    ws.acked(job)
    assert got == []
