"""Load shedding from worker heartbeats. Pure and synchronous: callers pass ``now``.

Each :class:`~bus.messages.WorkerStatus` is remembered by worker id with the *local* time it
arrived (worker clocks are not trusted). A worker is live while its last heartbeat is younger than
``stale_after_s``; a draining worker counts as alive (for ``/readyz``) but takes no new work.

For a tier ``t`` the expected wait is the mean of ``est_wait_s[t]`` over the live, non-draining
workers serving the model, each weighted by the partitions it owns (``WorkerStatus.partitions``;
equal weights when none say): a request lands on the worker that owns its key's partition, not on
the least-loaded one, so an idle worker must not hide a saturated one. Each worker's estimate counts
its consumer lag (records still on the topic in its partitions), so a backlog on Kafka sheds.
A new request of tier ``t`` is shed with ``overloaded`` when:

* no live worker serves the model (``retry_after`` = ``stale_after_s``); or
* that wait exceeds ``slo_wait_s[t]``, or the tier's TTFT target ``slo_ttft_s[t]`` (the wait is the
  workers' prediction of the time to a new request's first chunk, from the prompt tokens queued
  ahead and the measured step time: a request that cannot meet its tier's TTFT is refused now
  rather than queued to miss it) (``retry_after`` = the excess, clamped to 1..30 s); or
* ``max_queue_depth[t] > 0`` and every live worker's ``queue_depth[t]`` is at or above it.

New WebSocket connections of a tier being shed get HTTP 503 with ``Retry-After``. :meth:`LoadShedder.place`
with ``demote``: a request its tier cannot take goes to the first lower tier that can (the edge's
``slo_demote``), else it is shed with its own tier's reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bus import WorkerStatus

MIN_RETRY_S = 1.0
MAX_RETRY_S = 30.0


@dataclass(frozen=True, slots=True)
class Shed:
    reason: str
    retry_after: float


class LoadShedder:
    def __init__(
        self,
        model: str,
        slo_wait_s: tuple[float, ...],
        max_queue_depth: tuple[int, ...] = (0, 0, 0),
        stale_after_s: float = 3.0,
        max_workers: int = 4096,
        slo_ttft_s: tuple[float, ...] | None = None,
    ) -> None:
        self.model = model
        self.slo_wait_s = tuple(slo_wait_s)
        # the objective per tier: the smaller of the wait limit and the TTFT target
        self.objective_s = self.slo_wait_s if slo_ttft_s is None else \
            tuple(min(w, t) for w, t in zip(self.slo_wait_s, slo_ttft_s, strict=True))
        self.max_queue_depth = tuple(max_queue_depth)
        self.stale_after_s = stale_after_s
        self.max_workers = max_workers
        self._workers: dict[str, tuple[float, WorkerStatus]] = {}
        self._last_seen: float | None = None

    def observe(self, status: WorkerStatus, now: float) -> None:
        """Record one heartbeat. Heartbeats of other models are ignored."""
        if status.model != self.model:
            return
        self._workers[status.worker_id] = (now, status)
        self._last_seen = now
        if len(self._workers) > self.max_workers:  # bound memory: forget the stalest
            self.prune(now)
            while len(self._workers) > self.max_workers:
                oldest = min(self._workers, key=lambda w: self._workers[w][0])
                del self._workers[oldest]

    def prune(self, now: float) -> None:
        """Forget workers silent for 10x the stale limit."""
        horizon = now - 10 * self.stale_after_s
        for wid in [w for w, (t, _) in self._workers.items() if t < horizon]:
            del self._workers[wid]

    def live(self, now: float) -> list[WorkerStatus]:
        return [s for t, s in self._workers.values() if now - t <= self.stale_after_s]

    def serving(self, now: float) -> list[WorkerStatus]:
        return [s for s in self.live(now) if not s.draining]

    def readiness(self, now: float) -> tuple[bool, str]:
        """(ready, why) for ``/readyz``'s worker half."""
        live = self.live(now)
        if live:
            serving = [s for s in live if not s.draining]
            if serving:
                return True, f"{len(serving)} live worker(s) for {self.model}"
            return False, f"{len(live)} live worker(s) for {self.model}, all draining"
        if self._last_seen is None:
            return False, f"no worker heartbeat for {self.model} received yet"
        return False, f"no live worker for {self.model}: last heartbeat {now - self._last_seen:.1f}s ago " \
                      f"(stale after {self.stale_after_s:g}s)"

    def check(self, tier: int, now: float) -> Shed | None:
        """``None`` to admit a request of ``tier``; else why it is shed and when to retry."""
        serving = self.serving(now)
        if not serving:
            ok, why = self.readiness(now)
            return Shed(why, self.stale_after_s)
        weights = [s.partitions for s in serving] if all(s.partitions > 0 for s in serving) else [1] * len(serving)
        wait = sum(w * _at(s.est_wait_s, tier, 0.0) for w, s in zip(weights, serving, strict=True)) / sum(weights)
        slo = self.objective_s[tier]
        if not math.isfinite(wait) or wait > slo:
            excess = wait - slo if math.isfinite(wait) else MAX_RETRY_S
            return Shed(
                f"estimated wait for tier p{tier} is {wait:.1f}s, over the {slo:g}s objective",
                min(MAX_RETRY_S, max(MIN_RETRY_S, round(excess, 2))),
            )
        limit = self.max_queue_depth[tier]
        if limit:
            depth = min(_at(s.queue_depth, tier, 0) for s in serving)
            if depth >= limit:
                return Shed(f"queue depth for tier p{tier} is {depth}, limit {limit}", MIN_RETRY_S)
        return None


    def place(self, tier: int, now: float, demote: bool = False) -> int | Shed:
        """The tier a new request of ``tier`` is queued on, or why it is shed: ``tier`` when
        :meth:`check` admits it; with ``demote``, else the first lower tier it admits."""
        shed = self.check(tier, now)
        if shed is None:
            return tier
        if demote:
            for lower in range(tier + 1, len(self.objective_s)):
                if self.check(lower, now) is None:
                    return lower
        return shed


def _at(values: tuple, i: int, default):
    return values[i] if i < len(values) else default
