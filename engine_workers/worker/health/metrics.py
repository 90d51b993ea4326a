"""Prometheus metrics of one worker, in a registry of its own (several workers per process work).

Names follow vLLM's (``vllm:`` -> ``lockgate:``) where the meaning is the same, so existing
dashboards port by a prefix swap:

========================================  ==========  ==========================================
``lockgate:time_to_first_token_seconds``  histogram   model, tier — enqueue to first token
``lockgate:time_per_output_token_seconds`` histogram  model, tier — a.k.a. inter-token latency
``lockgate:e2e_request_latency_seconds``  histogram   model, tier — enqueue to finish
``lockgate:request_queue_time_seconds``   histogram   model, tier — enqueue to first scheduled
``lockgate:num_requests_running``         gauge       model, tier
``lockgate:num_requests_waiting``         gauge       model, tier — intake + engine queue
``lockgate:kv_cache_usage_perc``          gauge       model — 0..1, as vLLM
``lockgate:gpu_memory_utilization``       gauge       model — CUDA: device memory in use, 0..1; absent on CPU
``lockgate:prompt_tokens_total``          counter     model
``lockgate:generation_tokens_total``      counter     model
``lockgate:prefix_cache_queries_total``   counter     model — prompt tokens looked up
``lockgate:prefix_cache_hits_total``      counter     model — prompt tokens found cached
``lockgate:num_preemptions_total``        counter     model
``lockgate:request_success_total``        counter     model, finished_reason (vLLM's label name)
``lockgate:iteration_tokens_total``       histogram   model — tokens per engine step (vLLM's name)
``lockgate:iteration_seqs``               histogram   model — sequences per engine step
``lockgate:spec_decode_num_drafts_total``  counter    model — speculative verification chunks run
``lockgate:spec_decode_num_draft_tokens_total`` counter model — tokens proposed in them
``lockgate:spec_decode_num_accepted_tokens_total`` counter model — of those, accepted
========================================  ==========  ==========================================

Tier labels are ``p0``/``p1``/``p2``, as on the edge. Batch-size histograms are observed by the
engine thread once per step (prometheus-client is thread-safe).

Plus lockgate-only counters: ``lockgate:request_errors_total`` (model, code) and
``lockgate:dead_letters_total``; per tenant (``worker/health/usage.py``, labels model, tenant):
``lockgate:tenant_prompt_tokens_total``, ``lockgate:tenant_completion_tokens_total``,
``lockgate:tenant_cached_tokens_total``, and ``lockgate:usage_send_failures_total``. The worker is identified by its scrape target (one registry and
one ``/metrics`` port per worker), not by a label. Not
thread-safe by contract: updated from the worker's event loop only (prometheus-client itself is).
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine_workers.engine.async_engine import EngineSnapshot

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
BATCH_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def tier_label(tier: int) -> str:
    return f"p{int(tier)}"


class WorkerMetrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = r = CollectorRegistry()
        mt = ["model", "tier"]
        m = ["model"]
        self.ttft = Histogram("lockgate:time_to_first_token_seconds", "Time to first token (enqueue to first token).",
                              mt, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("lockgate:time_per_output_token_seconds", "Mean time per output token after the first "
                              "(inter-token latency).", mt, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("lockgate:e2e_request_latency_seconds", "End-to-end request latency (enqueue to finish).",
                             mt, buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("lockgate:request_queue_time_seconds", "Queue time (enqueue to first scheduled).",
                               mt, buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("lockgate:num_requests_running", "Requests running in the engine.", mt, registry=r)
        self.waiting = Gauge("lockgate:num_requests_waiting", "Requests waiting (intake + engine queue).", mt,
                             registry=r)
        self.kv_usage = Gauge("lockgate:kv_cache_usage_perc", "KV-cache usage (0..1).", m, registry=r)
        self.gpu_memory = Gauge("lockgate:gpu_memory_utilization", "CUDA device memory in use, by any process "
                                "(0..1; cudaMemGetInfo). Absent on CPU.", m, registry=r)
        self.prompt_tokens = Counter("lockgate:prompt_tokens", "Prompt tokens processed.", m, registry=r)
        self.generation_tokens = Counter("lockgate:generation_tokens", "Tokens generated.", m, registry=r)
        self.prefix_queries = Counter("lockgate:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m, registry=r)
        self.prefix_hits = Counter("lockgate:prefix_cache_hits", "Prompt tokens found in the prefix cache.", m, registry=r)
        self.preemptions = Counter("lockgate:num_preemptions", "Preemptions (recompute).", m, registry=r)
        self.success = Counter("lockgate:request_success", "Finished requests.", ["model", "finished_reason"],
                               registry=r)
        self.errors = Counter("lockgate:request_errors", "Requests answered with an Error.", ["model", "code"],
                              registry=r)
        self.dead_letters = Counter("lockgate:dead_letters", "Records sent to the dead-letter topic: undecodable, or naming a reply topic that does not exist.", registry=r)
        self.resumed_requests = Counter(
            "lockgate:resumed_requests", "Requests taken over from another worker that continued after the tokens "
            "already published for them (engine_workers.worker.pipeline.resume).", registry=r)
        self.resumed_tokens = Counter(
            "lockgate:resumed_tokens", "Output tokens already published by another worker, not generated again.",
            registry=r)
        self.answered_before = Counter(
            "lockgate:answered_before_takeover", "Requests taken over whose final reply was already published: "
            "committed without running.", registry=r)
        self.iteration_tokens = Histogram("lockgate:iteration_tokens_total", "Tokens per engine step.", m,
                                          buckets=BATCH_TOKEN_BUCKETS, registry=r)
        self.iteration_seqs = Histogram("lockgate:iteration_seqs", "Sequences per engine step.", m,
                                        buckets=BATCH_SEQ_BUCKETS, registry=r)
        # speculative decoding (vLLM's names): acceptance rate = accepted / draft tokens, mean
        # accepted length = 1 + accepted / drafts
        self.spec_drafts = Counter("lockgate:spec_decode_num_drafts", "Speculative drafts verified.", m, registry=r)
        self.spec_draft_tokens = Counter("lockgate:spec_decode_num_draft_tokens", "Speculative tokens proposed.", m,
                                         registry=r)
        self.spec_accepted_tokens = Counter("lockgate:spec_decode_num_accepted_tokens",
                                            "Speculative tokens accepted.", m, registry=r)
        # vLLM's lora_requests_info: one series, its labels the running and waiting adapters
        # (comma-separated) and the per-batch cap, its value the time it was set
        self.lora_info = Gauge("lockgate:lora_requests_info", "LoRA adapters of the running and waiting requests.",
                               ["model", "running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
        self._last = EngineSnapshot()

    def resumed(self, tokens: int) -> None:
        """A request resumes after ``tokens`` output tokens another worker published."""
        self.resumed_requests.inc()
        self.resumed_tokens.inc(tokens)

    def observe_finished(self, tier: int, reason: str, queue: float, ttft: float | None, tpot: float | None,
                         e2e: float) -> None:
        t = tier_label(tier)
        self.success.labels(self.model, reason).inc()
        self.queue.labels(self.model, t).observe(queue)
        self.e2e.labels(self.model, t).observe(e2e)
        if ttft is not None:
            self.ttft.labels(self.model, t).observe(ttft)
        if tpot is not None:
            self.tpot.labels(self.model, t).observe(tpot)

    def observe_tokens(self, prompt: int, generated: int) -> None:
        if prompt:
            self.prompt_tokens.labels(self.model).inc(prompt)
        if generated:
            self.generation_tokens.labels(self.model).inc(generated)

    def observe_error(self, code: str) -> None:
        self.errors.labels(self.model, code).inc()

    def observe_step(self, tokens: int, seqs: int) -> None:
        """Batch size of one engine step; called on the engine thread (AsyncEngine.on_step)."""
        self.iteration_tokens.labels(self.model).observe(tokens)
        self.iteration_seqs.labels(self.model).observe(seqs)

    def observe_snapshot(self, snap: EngineSnapshot, waiting: tuple[int, ...], running: tuple[int, ...]) -> None:
        """Gauges from the latest engine snapshot and the worker's per-tier counts, counters by
        their deltas since the last call."""
        last, self._last = self._last, snap
        for tier, n in enumerate(running):
            self.running.labels(self.model, tier_label(tier)).set(n)
        self.kv_usage.labels(self.model).set(snap.kv_usage)
        if snap.gpu_memory_utilization is not None:  # no series at all on a CPU
            self.gpu_memory.labels(self.model).set(snap.gpu_memory_utilization)
        for tier, n in enumerate(waiting):
            self.waiting.labels(self.model, tier_label(tier)).set(n)
        if snap.max_loras:
            self.lora_info.clear()
            self.lora_info.labels(self.model, ",".join(snap.running_loras), ",".join(snap.waiting_loras),
                                  str(snap.max_loras)).set(time.time())
        for counter, now, before in ((self.prefix_queries, snap.prefix_queries, last.prefix_queries),
                                     (self.prefix_hits, snap.prefix_hits, last.prefix_hits),
                                     (self.preemptions, snap.preemptions, last.preemptions),
                                     (self.spec_drafts, snap.spec_num_drafts, last.spec_num_drafts),
                                     (self.spec_draft_tokens, snap.spec_num_draft_tokens, last.spec_num_draft_tokens),
                                     (self.spec_accepted_tokens, snap.spec_num_accepted_tokens,
                                      last.spec_num_accepted_tokens)):
            if now > before:
                counter.labels(self.model).inc(now - before)

    def render(self) -> bytes:
        return generate_latest(self.registry)
