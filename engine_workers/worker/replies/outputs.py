"""The engine's per-step outputs, turned into replies (docs/worker.md, "Outputs").

For each request in a step's outputs: its new tokens become a ``TokenChunk`` (``reply_sender``),
its end a ``Finished`` or an ``Error(expired)`` (``answers``); a request that lost its partition
or its reply stream (``job.lost``) publishes nothing more and is forgotten once it leaves the
engine. Each step also aborts the running requests past their deadline (at most every
``EXPIRY_CHECK_S``). Runs on the event loop, from the worker's ``AsyncEngine.on_outputs``.
"""

from __future__ import annotations

import time

from bus import ErrorCode
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.engine.outputs import RequestOutput
from engine_workers.worker.health.metrics import WorkerMetrics
from engine_workers.worker.offsets.ledger import RequestLedger
from engine_workers.worker.replies.answers import Answers
from engine_workers.worker.replies.sender import ReplySender

EXPIRY_CHECK_S = 0.25  # how often running requests are checked against their deadlines


class StepOutputs:
    """Publishes a step's outputs (:meth:`publish`); holds only the time of the next expiry check."""

    def __init__(self, aengine: AsyncEngine, ledger: RequestLedger, replies: ReplySender, answers: Answers,
                 metrics: WorkerMetrics) -> None:
        self.aengine, self.ledger, self.replies, self.answers, self.metrics = aengine, ledger, replies, answers, metrics
        self._next_expiry_check = 0.0

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Replies for ``outputs`` (non-blocking: queued on the sender), token counts into the
        metrics, then the deadline check of the running requests."""
        prompt = generated = 0
        for out in outputs:
            job = self.ledger.get(out.request_id)
            if job is None:
                continue
            if not job.started and job.admitted and out.token_ids:
                self.ledger.started(job)
                prompt += out.num_prompt_tokens
            generated += len(out.token_ids)
            if job.lost:
                if out.finished:
                    self.ledger.left_engine(job)
                    self.ledger.forget(job)
                continue
            r = job.req
            if out.token_ids or out.text:
                self.replies.chunk(job.eid, r.reply_to, r.request_id, r.attempt, out.seq, out.token_ids, out.text,
                                   out.text_offset, out.logprobs)
            if out.finished:
                self.ledger.left_engine(job)
                if job.expiring:
                    self.answers.error(job, ErrorCode.EXPIRED, f"deadline passed while running; stopped after "
                                      f"{out.num_output_tokens} tokens")
                else:
                    self.answers.finished(job, out)
        self.metrics.observe_tokens(prompt, generated)
        self.expire_running()

    def expire_running(self) -> None:
        """Abort admitted requests past their deadline (checked at most every ``EXPIRY_CHECK_S``,
        from the step callback). A live edge cancels a stream at its deadline itself; this bounds
        the work of a requester that died without cancelling (an edge crash): its requests would
        otherwise run to ``max_tokens`` for nobody."""
        now = time.time()
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + EXPIRY_CHECK_S
        for job in self.ledger.overdue(now):
            job.expiring = True
            self.aengine.abort(job.eid)  # frees its KV before the next step; the final output follows
