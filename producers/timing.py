"""One request's client-side timings and their summary statistics, with the definitions of
vLLM's ``benchmark_serving`` (all times in seconds, measured by the client):

* TTFT  = first token arrival - send time;
* E2E   = last reply (done) arrival - send time;
* TPOT  = (E2E - TTFT) / (output_tokens - 1) when output_tokens > 1 (else the request has no TPOT
  sample);
* ITL   = the gaps between consecutive chunk arrivals (a chunk may carry several tokens).

Percentiles interpolate linearly between order statistics (``numpy.percentile``'s default), so
figures compare with vLLM's. Pure: no asyncio, no bus. Replay reports with them; the serving
benchmark builds its goodput and SLO figures on them (``benchmarks.stats``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """What one client observed for one request. ``chunk_times`` are arrival times (any clock,
    same as ``sent_at``) of each reply chunk, in order; ``ok`` is False for errors/aborts."""

    sent_at: float
    chunk_times: tuple[float, ...]
    done_at: float
    output_tokens: int
    prompt_tokens: int = 0
    tier: int = 1
    ok: bool = True
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.done_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> tuple[float, ...]:
        c = self.chunk_times
        return tuple(b - a for a, b in zip(c, c[1:]))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Summary:
    """mean/median/p99 (and p50 = median) of a sample, in the sample's unit; NaN when empty."""

    count: int
    mean: float
    median: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Summary:
        xs = [float(v) for v in values]
        if not xs:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(len(xs), sum(xs) / len(xs), percentile(xs, 50), percentile(xs, 99), min(xs), max(xs))

    def scaled(self, k: float) -> Summary:
        return Summary(self.count, self.mean * k, self.median * k, self.p99 * k, self.min * k, self.max * k)

    def to_dict(self) -> dict[str, float | int | None]:
        def f(x: float) -> float | None:
            return None if math.isnan(x) else round(x, 3)
        return {"count": self.count, "mean": f(self.mean), "median": f(self.median), "p99": f(self.p99),
                "min": f(self.min), "max": f(self.max)}
