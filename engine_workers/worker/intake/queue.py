"""The worker's intake: an aging priority queue between the bus and the engine. Pure.

No asyncio, no Kafka, no torch: every method takes ``now`` (UNIX seconds, the clock of
``InferenceRequest.enqueued_at``) explicitly, so tests drive it with a simulated clock.

Policy (``IntakePolicy``), with ``P`` = ``aging_period_s`` and ``wait = now - enqueued_at``:

* ``strict``: effective priority = tier rank. A lower tier is never admitted while a higher one
  waits (starves under sustained p0 load).
* ``fifo``:   effective priority = ``-wait / P``. Arrival order, tiers ignored.
* ``aging``:  effective priority = ``tier - wait / P`` (the default). Every ``P`` seconds of
  waiting buys one tier step, so a tier-``t`` request is admitted before any p0 request that arrived
  more than ``t * P`` seconds after it: it never waits more than ``t * P`` longer than the p0
  traffic of its time (see docs/worker.md for the bound and the default ``P`` = 2 s).

Lower effective priority = admitted first; ties are FIFO (by ``enqueued_at``, then by push order).
In every mode ``effective_priority(now) = static_key - now / P`` (or has no ``now`` term), so the
relative order of two queued requests never changes with time: the queue is a plain heap on a
time-invariant key, and :meth:`IntakePolicy.engine_priority` (the effective priority at a fixed
reference instant) gives values that stay comparable across admissions made at different times.

Not thread-safe: one owner (the worker's event loop).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from engine_workers.worker.intake.fair import DEFAULT_WEIGHT, FairShare

T = TypeVar("T")

DEFAULT_AGING_PERIOD_S = 2.0
# A record's time on the topic counts for at most this many aging periods (docs/worker.md,
# "A cap on the age a backlog brings"): one tier step, so neither an old backlog nor a forged
# ``enqueued_at`` sorts a record ahead of p0 requests queued before its fetch.
DEFAULT_AGE_CREDIT_PERIODS = 1.0
NUM_TIERS = 3
MAX_EST_WAIT_S = 3600.0  # est_wait_s is capped (the heartbeat carries finite numbers only)


class IntakeMode(StrEnum):
    FIFO = "fifo"
    STRICT = "strict"
    AGING = "aging"


def parse_intake_mode(value: IntakeMode | str) -> IntakeMode:
    """``value`` as an :class:`IntakeMode`; ValueError naming the valid modes if it is none."""
    try:
        return IntakeMode(value)
    except ValueError:
        raise ValueError(f"intake mode must be one of {[m.value for m in IntakeMode]}, got {value!r}") from None


def aging_start(enqueued_at: float, fetched_at: float, aging_period_s: float,
                credit_periods: float | None) -> float:
    """The instant a request's aging counts from: its enqueue time (never after this worker
    fetched it: a producer clock running ahead cannot make a request look younger), and with
    ``credit_periods`` set, at most that many aging periods before the fetch.

    The trade-off (docs/worker.md, "Intake and aging"): without a cap every second a record waited
    on the topic counts, so a p2 request never waits more than ``2 P`` longer than the p0 traffic
    of its time, but a large p2 backlog (a batch job, a replay, a worker outage) arrives with
    minutes of age and is admitted ahead of every fresh p0 request until it has drained. With a
    cap ``C``, a record fetched at ``f`` ranks as if it had arrived at ``f - C P`` at the earliest,
    so a fresh p0 request is passed only by lower-tier records that already waited in this
    worker's intake, while p2 records waiting on the topic longer than ``C P`` lose the excess."""
    start = min(enqueued_at, fetched_at)
    if credit_periods is None:
        return start
    return max(start, fetched_at - credit_periods * aging_period_s)


@dataclass(frozen=True, slots=True)
class IntakePolicy:
    """How queued requests are ordered. ``reference_time`` anchors :meth:`engine_priority`."""

    mode: IntakeMode = IntakeMode.AGING
    aging_period_s: float = DEFAULT_AGING_PERIOD_S
    reference_time: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", parse_intake_mode(self.mode))  # a plain string is accepted too
        if not isinstance(self.aging_period_s, (int, float)) or not self.aging_period_s > 0:
            raise ValueError(f"aging_period_s must be > 0, got {self.aging_period_s!r}")

    def effective_priority(self, tier: int, enqueued_at: float, now: float) -> float:
        """The priority of a request at ``now``; lower = more urgent."""
        wait = now - enqueued_at
        if self.mode is IntakeMode.STRICT:
            return float(tier)
        if self.mode is IntakeMode.FIFO:
            return -wait / self.aging_period_s
        return tier - wait / self.aging_period_s

    def engine_priority(self, tier: int, enqueued_at: float) -> float:
        """The value passed as the engine's ``priority`` at admission: the effective priority at
        ``reference_time``. It differs from ``effective_priority(now)`` by the same constant
        ``(now - reference_time) / P`` for every request, so the engine's waiting queue (and its
        preemption victim choice) orders requests admitted at different times exactly as the
        intake does."""
        return self.effective_priority(tier, enqueued_at, self.reference_time)

    def sort_key(self, tier: int, enqueued_at: float) -> tuple[float, float]:
        """Time-invariant heap key: (effective priority + now/P, enqueued_at)."""
        if self.mode is IntakeMode.STRICT:
            return (float(tier), enqueued_at)
        if self.mode is IntakeMode.FIFO:
            return (enqueued_at / self.aging_period_s, enqueued_at)
        return (tier + enqueued_at / self.aging_period_s, enqueued_at)


@dataclass(frozen=True, slots=True, eq=False)
class Pending(Generic[T]):
    """One queued request. ``item`` is the caller's payload; identity semantics."""

    request_id: str
    tier: int
    enqueued_at: float
    deadline: float | None
    item: T


class IntakeQueue(Generic[T]):
    """Priority queue of :class:`Pending` under an :class:`IntakePolicy`.

    ``pop`` is O(log n); removals (cancel, revoke, expiry) are lazy (marked, skipped on pop), and
    ``expire``/``remove_if`` scan the live entries: the worker keeps the intake small (bounded
    prefetch), so a scan is cheap.

    ``fair_share``: within a tier, requests are admitted by start-time fair queueing across tenants
    (``fair.py``), not FIFO. Across tiers the policy still decides, on the *oldest* request of each
    tier: the tier whose oldest request has the smallest key gets the next admission, and the fair
    order picks which of its tenants' requests takes it. So aging (a tier's claim grows with how long
    its work has waited) is unchanged, whoever's request it was that waited.
    """

    def __init__(self, policy: IntakePolicy, fair_share: bool = False) -> None:
        self.policy = policy
        self.fair: FairShare | None = FairShare(NUM_TIERS) if fair_share else None
        self._heap: list[tuple[tuple[float, float], int, Pending[T]]] = []
        # fair share: per tier, (start tag, push order) and (policy key of its oldest, push order)
        self._fair: list[list[tuple[float, int, Pending[T]]]] = [[] for _ in range(NUM_TIERS)]
        self._age: list[list[tuple[tuple[float, float], int, Pending[T]]]] = [[] for _ in range(NUM_TIERS)]
        self._live: dict[int, Pending[T]] = {}  # id(pending) -> pending
        self._order = itertools.count()
        self._depth = [0] * NUM_TIERS

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Pending[T]]:
        return iter(list(self._live.values()))

    def depth(self) -> tuple[int, ...]:
        """Queued requests per tier (index = tier rank)."""
        return tuple(self._depth)

    def push(self, request_id: str, tier: int, enqueued_at: float, deadline: float | None, item: T,
             tenant: str = "", cost: float = 1.0, weight: float = DEFAULT_WEIGHT) -> Pending[T]:
        """Queue a request. ``tenant``, ``cost`` (tokens) and ``weight`` matter under fair share only."""
        if not 0 <= tier < NUM_TIERS:
            raise ValueError(f"tier must be in [0, {NUM_TIERS}), got {tier}")
        p = Pending(request_id, tier, enqueued_at, deadline, item)
        order, key = next(self._order), self.policy.sort_key(tier, enqueued_at)
        if self.fair is None:
            heapq.heappush(self._heap, (key, order, p))
        else:
            start = self.fair.tag(tier, tenant, cost, weight)
            heapq.heappush(self._fair[tier], (start, order, p))
            heapq.heappush(self._age[tier], (key, order, p))
        self._live[id(p)] = p
        self._depth[tier] += 1
        return p

    def _is_live(self, p: Pending[T]) -> bool:
        return self._live.get(id(p)) is p

    def _fair_tier(self) -> int | None:
        """Under fair share: the tier admitted next (smallest policy key of its oldest request)."""
        best: tuple[tuple[float, float], int] | None = None
        tier_best = None
        for tier in range(NUM_TIERS):
            if not self._depth[tier]:
                continue
            age = self._age[tier]
            while age and not self._is_live(age[0][2]):
                heapq.heappop(age)
            if age and (best is None or (age[0][0], age[0][1]) < best):
                best, tier_best = (age[0][0], age[0][1]), tier
        return tier_best

    def peek(self) -> Pending[T] | None:
        """The request admitted next, without removing it."""
        heap: list = self._heap
        if self.fair is not None:
            tier = self._fair_tier()
            if tier is None:
                return None
            heap = self._fair[tier]
        while heap:
            p = heap[0][2]
            if self._is_live(p):
                return p
            heapq.heappop(heap)
        return None

    def pop(self) -> Pending[T] | None:
        p = self.peek()
        if p is not None:
            if self.fair is None:
                heapq.heappop(self._heap)
            else:
                start = heapq.heappop(self._fair[p.tier])[0]
                self.fair.admitted(p.tier, start)
            self._forget(p)
        return p

    def _forget(self, p: Pending[T]) -> None:
        del self._live[id(p)]
        self._depth[p.tier] -= 1

    def remove(self, p: Pending[T]) -> bool:
        if not self._is_live(p):
            return False
        self._forget(p)
        if self.fair is not None:
            self.fair.dropped(p.tier)
        return True

    def remove_if(self, pred: Callable[[Pending[T]], bool]) -> list[Pending[T]]:
        """Remove and return every queued request matching ``pred`` (cancel by id, revoke)."""
        out = [p for p in self._live.values() if pred(p)]
        for p in out:
            self._forget(p)
            if self.fair is not None:
                self.fair.dropped(p.tier)
        self._compact()
        return out

    def expire(self, now: float) -> list[Pending[T]]:
        """Remove and return the requests whose deadline is at or before ``now``."""
        return self.remove_if(lambda p: p.deadline is not None and p.deadline <= now)

    def _compact(self) -> None:
        heaps: list[list] = [self._heap, *self._fair, *self._age]
        for heap in heaps:
            if len(heap) > 2 * len(self._live) + 64:
                heap[:] = [e for e in heap if self._is_live(e[2])]
                heapq.heapify(heap)

    def ahead_of(self, tier: int, now: float) -> int:
        """How many queued requests a request of ``tier`` arriving ``now`` would wait behind
        (by the policy's key; under fair share an estimate)."""
        return len(self.queued_ahead(tier, now))

    def queued_ahead(self, tier: int, now: float) -> list[Pending[T]]:
        """The queued requests a request of ``tier`` arriving ``now`` would wait behind."""
        key = self.policy.sort_key(tier, now)
        return [p for p in self._live.values() if self.policy.sort_key(p.tier, p.enqueued_at) <= key]


class RateMeter:
    """Events per second over a sliding window (admissions, for the heartbeat's wait estimate).

    The last ``keep`` events are kept past the window: with fewer events in the window the rate is
    theirs over the time since the oldest of them, so it decays smoothly while nothing happens
    (``keep / elapsed``). Emptying the window instead made the rate 0 after ``window_s`` without an
    admission (an idle spell, or long requests holding every slot), and the wait estimate jumped to
    its cap: the edge then shed the burst that followed."""

    def __init__(self, window_s: float = 10.0, max_events: int = 4096, keep: int = 8) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if not 1 <= keep <= max_events:
            raise ValueError(f"keep must be in 1..max_events, got {keep}")
        self.window_s = window_s
        self.keep = keep
        self._events: deque[float] = deque(maxlen=max_events)

    def record(self, now: float, n: int = 1) -> None:
        for _ in range(n):
            self._events.append(now)

    def rate(self, now: float) -> float:
        """Events per second; 0 only before the first event."""
        while len(self._events) > self.keep and self._events[0] < now - self.window_s:
            self._events.popleft()
        if not self._events:
            return 0.0
        span = max(now - self._events[0], 1.0)
        return len(self._events) / span


def estimate_wait(ahead: int, rate: float) -> float:
    """Seconds until a request with ``ahead`` requests before it is admitted, at ``rate`` per s
    (0: no admission seen yet, so no measure: the cap)."""
    if ahead <= 0:
        return 0.0
    if rate <= 0:
        return MAX_EST_WAIT_S
    return min(ahead / rate, MAX_EST_WAIT_S)
