"""The worker's configuration (``lockgate worker`` flags map onto it: ``lockgate.commands.worker``).

A frozen value checked when built, so a bad setting fails at start-up with the field named, never
mid-run. Pure: no asyncio, Kafka or torch.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from bus import TopicLayout, safe_name
from engine_workers.worker.intake.queue import (
    DEFAULT_AGE_CREDIT_PERIODS,
    DEFAULT_AGING_PERIOD_S,
    NUM_TIERS,
    IntakeMode,
    IntakePolicy,
    parse_intake_mode,
)

DEFAULT_SLO_TTFT_MS = (500.0, 2000.0, 30000.0)
DEFAULT_SLO_TPOT_MS = (50.0, 100.0, 250.0)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: str  # the served model name: topics and the ``InferenceRequest.model`` check
    worker_id: str = field(default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}")
    layout: TopicLayout = field(default_factory=TopicLayout)
    intake_mode: IntakeMode | str = IntakeMode.AGING
    aging_period_s: float = DEFAULT_AGING_PERIOD_S
    # Aging periods of time on the topic that count, at most (intake.aging_start); None = all.
    # Bounded by default: a record's enqueued_at is the producer's word, and an unbounded credit let
    # any writer of a request topic (or an old backlog) sort ahead of every fresh p0 request.
    age_credit_periods: float | None = DEFAULT_AGE_CREDIT_PERIODS
    # Within a tier, share admissions across tenants by start-time fair queueing over tokens, at
    # each request's ``weight`` (worker/intake/fair.py; docs/worker.md, "Fair share"); off: FIFO per tier.
    fair_share: bool = True
    prefetch_per_tier: int = 4
    # Status period. Also the failover's clock: a peer silent for failover_detect_s (default 3
    # periods: 0.6 s) is presumed dead and its requests are taken over (docs/worker.md, "Failover").
    heartbeat_s: float = 0.2
    failover: bool = True
    failover_detect_s: float | None = None  # None: 3 heartbeat periods
    drain_grace_s: float = 30.0
    revoke_flush_s: float = 1.0  # on revoke, wait this long for final replies in flight before committing
    # The intake loop commits finished work at most this often (0: after every poll). Each commit is
    # a write to the broker's __consumer_offsets log; at one per 50 ms poll a fleet of workers would
    # send thousands a second. Drain, revoke and stop commit at once whatever the interval; a crash re-runs
    # at most this much more finished work elsewhere (the reply consumer drops it by seq).
    commit_interval_s: float = 1.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None = no HTTP server; 0 = any free port
    send_retries: int = 3
    # A request whose replies still failed after send_retries runs again this many times, then is
    # answered with an error, then dead-lettered (send_failures.py): never left pinning its partition.
    send_failure_reruns: int = 2
    # Reply records are split to stay under this many bytes: the producer's max request size
    # (Kafka's max.request.size, 1 MiB by default; a bigger one needs ?max_request_size= on the bus
    # URL and the broker's message.max.bytes raised too).
    max_reply_record_bytes: int = 1 << 20
    group_id: str | None = None  # default ``<ns>.workers.<model>``
    # Per-tier latency targets, p0, p1, p2 (docs/worker.md, "SLOs"): p0's are the design guide's
    # (P99 TTFT < 500 ms, TPOT < 50 ms); p1 and p2 looser. TPOT sizes the engine's steps (the
    # strictest target among the running decodes holds); TTFT is what the heartbeat's predicted
    # wait is held against at the edge.
    slo_ttft_ms: tuple[float, ...] = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: tuple[float, ...] = DEFAULT_SLO_TPOT_MS

    def __post_init__(self) -> None:
        mode = parse_intake_mode(self.intake_mode)
        IntakePolicy(mode, self.aging_period_s)  # validates aging_period_s
        if self.age_credit_periods is not None and not self.age_credit_periods >= 0:
            raise ValueError(f"age_credit_periods must be >= 0 or None, got {self.age_credit_periods}")
        object.__setattr__(self, "intake_mode", mode)
        for name in ("heartbeat_s", "drain_grace_s", "revoke_flush_s", "commit_interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.failover_detect_s is not None and not self.failover_detect_s > 0:
            raise ValueError(f"failover_detect_s must be > 0 or None, got {self.failover_detect_s!r}")
        if self.prefetch_per_tier < 1:
            raise ValueError(f"prefetch_per_tier must be >= 1, got {self.prefetch_per_tier}")
        if self.send_failure_reruns < 0:
            raise ValueError(f"send_failure_reruns must be >= 0, got {self.send_failure_reruns}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if len(v) != NUM_TIERS or not all(x > 0 for x in v):
                raise ValueError(f"{name} needs {NUM_TIERS} values > 0 (p0, p1, p2), got {v!r}")
            object.__setattr__(self, name, tuple(float(x) for x in v))
        if self.max_reply_record_bytes < 16 << 10:
            raise ValueError(f"max_reply_record_bytes must be >= 16384, got {self.max_reply_record_bytes}")

    @property
    def detect_s(self) -> float:
        """The failover's detection time: ``failover_detect_s``, else 3 heartbeat periods (at least
        50 ms)."""
        return self.failover_detect_s if self.failover_detect_s is not None else max(3 * self.heartbeat_s, 0.05)

    @property
    def group(self) -> str:
        return self.group_id or f"{self.layout.namespace}.workers.{safe_name(self.model)}"
