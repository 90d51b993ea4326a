"""The worker's spans of one request, children of the edge's (the ``traceparent`` header of the
request record): built only when the worker was given a tracer.

One ``lockgate.worker`` span (kind CONSUMER) from the record's fetch to the acknowledgement of its
final reply, parent of the phases, each recorded once its end is known:

* ``queue wait`` — fetch to the engine's first schedule (the intake, then the engine's own queue);
* ``prefill`` — first schedule to the first token;
* ``decode`` — first token to the last;
* ``reply send`` — the final reply queued to the bus's acknowledgement.

The engine phases come from the engine's own monotonic stamps (``RequestOutput.times``), turned
into wall-clock nanoseconds with one offset taken when the request finishes. A request re-run
after a failed send records its phases again under the same worker span; a request whose
partition moved (never answered here) ends no span: nothing is exported for it.
"""

from __future__ import annotations

import time

from bus import Error, Finished, Record
from engine_workers.engine.outputs import RequestOutput
from engine_workers.worker.offsets.ledger import Job
from tracing import SpanKind, Tracer, from_headers


class WorkerSpans:
    def __init__(self, tracer: Tracer, worker_id: str) -> None:
        self.tracer = tracer
        self.worker_id = worker_id

    def begin(self, job: Job, rec: Record) -> None:
        """The worker span of a fetched request record, child of the context its headers carry
        (a new trace when they carry none)."""
        r = job.req
        job.span = self.tracer.start("lockgate.worker", from_headers(rec.headers), SpanKind.CONSUMER, attributes={
            "lockgate.request_id": r.request_id, "lockgate.worker_id": self.worker_id, "lockgate.tier": r.tier,
            "lockgate.attempt": r.attempt, "messaging.destination.name": rec.topic,
            "messaging.destination.partition.id": str(rec.partition), "messaging.kafka.offset": rec.offset,
            "gen_ai.request.model": r.model})

    def engine_done(self, job: Job, out: RequestOutput) -> None:
        """The engine finished ``job``: its queue wait, prefill and decode spans."""
        span, t = job.span, out.times
        if span is None or t is None:
            return
        to_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> wall clock, for this request's stamps

        def ns(mono: float) -> int:
            return int(mono * 1e9) + to_ns

        rec = self.tracer.record
        if t.first_scheduled is not None:
            rec("queue wait", span, span.start_ns, ns(t.first_scheduled))
            if t.first_token is not None:
                rec("prefill", span, ns(t.first_scheduled), ns(t.first_token),
                    attributes={"gen_ai.usage.input_tokens": out.num_prompt_tokens,
                                "lockgate.cached_tokens": out.num_cached_tokens})
                if t.last_token is not None and t.last_token > t.first_token:
                    rec("decode", span, ns(t.first_token), ns(t.last_token),
                        attributes={"gen_ai.usage.output_tokens": out.num_output_tokens})
        span.set("gen_ai.usage.input_tokens", out.num_prompt_tokens)
        span.set("gen_ai.usage.output_tokens", out.num_output_tokens)

    def closing(self, job: Job, msg: Finished | Error) -> None:
        """``job``'s final reply was queued: the reply send span starts now."""
        span = job.span
        if span is None:
            return
        job.reply_queued_ns = time.time_ns()
        if not job.started:  # answered without running (expired, cancelled, refused): it only waited
            self.tracer.record("queue wait", span, span.start_ns, job.reply_queued_ns)
        if isinstance(msg, Error):
            span.fail(f"{msg.code}: {msg.message}")
        else:
            span.set("gen_ai.response.finish_reasons", msg.finish_reason)

    def acked(self, job: Job) -> None:
        """``job``'s final reply was acknowledged: the reply send span and the worker span end."""
        span = job.span
        if span is None or span.ended:
            return
        now = time.time_ns()
        if job.reply_queued_ns:
            self.tracer.record("reply send", span, job.reply_queued_ns, now)
        span.end(now)
