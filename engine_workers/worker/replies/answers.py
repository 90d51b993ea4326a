"""The worker's final replies: one ``Finished`` or ``Error`` per request, queued on the
:class:`ReplySender` behind the request's chunks; once the bus acknowledges it, the ledger finishes
the request's offset (it may be committed).

Concurrency: event loop only (the worker calls it from its intake and its output callback).
"""

from __future__ import annotations

import logging
import time

from bus import Error, Finished, Timings, Usage
from engine_workers.engine.outputs import RequestOutput
from engine_workers.worker.health.metrics import WorkerMetrics
from engine_workers.worker.health.usage import UsageLog
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.replies.sender import ReplySender
from engine_workers.worker.spans import WorkerSpans

log = logging.getLogger(__name__)


class Answers:
    def __init__(self, replies: ReplySender, ledger: RequestLedger, metrics: WorkerMetrics, worker_id: str,
                 usage: UsageLog | None = None, spans: WorkerSpans | None = None) -> None:
        self.spans = spans  # None: tracing off (worker/spans.py)
        self.usage = usage  # per-tenant usage of every request the engine finished (usage.py)
        self.replies = replies
        self.ledger = ledger
        self.metrics = metrics
        self.worker_id = worker_id

    def finished(self, job: Job, out: RequestOutput) -> None:
        """The engine finished ``job``: ``Finished`` with its usage and timings (and the metrics)."""
        assert out.finish_reason is not None  # a finished output always says why
        t, n = out.times, out.num_output_tokens
        timings = Timings()
        if t is not None:
            arr = t.arrival
            end = t.finished if t.finished is not None else time.monotonic()
            queue = max(0.0, (t.first_scheduled if t.first_scheduled is not None else end) - arr)
            ttft = max(0.0, t.first_token - arr) if t.first_token is not None else None
            tpot = (t.last_token - t.first_token) / (n - 1) if n > 1 and t.first_token and t.last_token else None
            timings = Timings(queue, ttft or 0.0, tpot or 0.0, max(0.0, end - arr))
            self.metrics.observe_finished(job.req.tier, out.finish_reason, queue, ttft, tpot, timings.e2e)
        usage = Usage(out.num_prompt_tokens, n, out.num_cached_tokens)
        fin = Finished(job.req.request_id, job.req.attempt, out.finish_reason, n, usage, timings, self.worker_id,
                       out.embedding)
        if self.spans is not None:
            self.spans.engine_done(job, out)
        if self.usage is None:
            self.close(job, fin)
            return
        job.closing = True
        log_usage, spans = self.usage, self.spans
        if spans is not None:
            spans.closing(job, fin)

        def acked() -> None:
            if spans is not None:
                spans.acked(job)
            self.ledger.answered(job)
            log_usage.record(job.req, fin)  # after the reply: the billing log never delays it

        self.replies.final(job.eid, job.req.reply_to, job.req.request_id, fin, acked)

    def error(self, job: Job, code: str, message: str) -> None:
        self.metrics.observe_error(code)
        r = job.req
        self.close(job, Error(r.request_id, code, message, r.attempt, worker_id=self.worker_id))

    def unrun(self, job: Job, reason: str) -> None:
        """``Finished`` with no output (a request cancelled before it ran)."""
        r = job.req
        self.close(job, Finished(r.request_id, r.attempt, reason, 0, Usage(len(r.prompt_token_ids), 0),
                                 worker_id=self.worker_id))

    def close(self, job: Job, msg: Finished | Error) -> None:
        job.closing = True
        spans = self.spans
        if spans is None:
            self.replies.final(job.eid, job.req.reply_to, job.req.request_id, msg, lambda: self.ledger.answered(job))
            return
        spans.closing(job, msg)

        def acked() -> None:
            spans.acked(job)
            self.ledger.answered(job)

        self.replies.final(job.eid, job.req.reply_to, job.req.request_id, msg, acked)

    def answered_before(self, job: Job, final: Finished | Error) -> None:
        """The request's final reply is already on its reply topic (its worker died before the
        commit): commit it without running or replying again."""
        log.info("worker %s: %s was answered already (%s); committing it", self.worker_id, job.eid,
                 getattr(final, "finish_reason", None) or getattr(final, "code", ""))
        self.metrics.answered_before.inc()
        self.ledger.answered(job)
