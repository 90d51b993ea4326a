"""Latency statistics and goodput, with the definitions of vLLM's ``benchmark_serving`` /
``vllm bench serve``. Pure: no asyncio, no bus, no torch, no numpy.

Per request (all times in seconds, measured by the client):

* TTFT  = first token arrival - send time;
* E2E   = last reply (done) arrival - send time;
* TPOT  = (E2E - TTFT) / (output_tokens - 1) when output_tokens > 1 (else the request has no TPOT
  sample; for goodput its TPOT counts as 0, as in vLLM);
* ITL   = the gaps between consecutive chunk arrivals (a chunk may carry several tokens).

Goodput = requests meeting every given SLO / benchmark duration. Percentiles interpolate linearly
between order statistics (``numpy.percentile``'s default), so figures compare with vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from producers.timing import RequestTiming, Summary

SLO_KEYS = ("ttft", "tpot", "e2e", "itl")


def parse_duration(text: str) -> float:
    """``500ms`` / ``0.5s`` / ``2`` (seconds) -> seconds."""
    t = text.strip().lower()
    try:
        if t.endswith("ms"):
            return float(t[:-2]) / 1000.0
        if t.endswith("us"):
            return float(t[:-2]) / 1e6
        if t.endswith("s"):
            return float(t[:-1])
        return float(t)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (examples: 500ms, 0.5s)") from None


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=500ms,tpot=50ms[,e2e=10s][,itl=..]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    out: dict[str, float] = {}
    if not text:
        return out
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: use NAME=DURATION with NAME in {', '.join(SLO_KEYS)}")
        seconds = parse_duration(value)
        if seconds <= 0:
            raise ValueError(f"SLO {key} must be > 0, got {value!r}")
        out[key] = seconds
    return out


def meets_slo(t: RequestTiming, slo: dict[str, float]) -> bool:
    """vLLM's goodput test: every given SLO holds (TPOT of a 1-token output counts as 0).
    ``itl`` (an extension) requires every inter-chunk gap to be within it."""
    if not t.ok or t.ttft is None:
        return False
    if "ttft" in slo and t.ttft > slo["ttft"]:
        return False
    if "tpot" in slo and (t.tpot or 0.0) > slo["tpot"]:
        return False
    if "e2e" in slo and t.e2e > slo["e2e"]:
        return False
    if "itl" in slo and any(g > slo["itl"] for g in t.itls):
        return False
    return True


@dataclass(frozen=True, slots=True)
class RunStats:
    """Figures of one benchmark run (one offered rate). Latencies in milliseconds."""

    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    good: int
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2e_ms: Summary
    total_input_tokens: int
    total_output_tokens: int
    errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "completed": self.completed, "failed": self.failed, "duration_s": round(self.duration_s, 3),
            "request_throughput": round(self.request_throughput, 4),
            "output_throughput": round(self.output_throughput, 3),
            "total_token_throughput": round(self.total_token_throughput, 3),
            "goodput": None if self.goodput is None else round(self.goodput, 4), "good": self.good,
            "total_input_tokens": self.total_input_tokens, "total_output_tokens": self.total_output_tokens,
            "ttft_ms": self.ttft_ms.to_dict(), "tpot_ms": self.tpot_ms.to_dict(), "itl_ms": self.itl_ms.to_dict(),
            "e2e_ms": self.e2e_ms.to_dict(), "errors": dict(self.errors),
        }


def run_stats(timings: Sequence[RequestTiming], duration_s: float, slo: dict[str, float] | None = None) -> RunStats:
    """Aggregate one run. ``duration_s`` is the wall time from the first send to the last reply."""
    ok = [t for t in timings if t.ok]
    errors: dict[str, int] = {}
    for t in timings:
        if not t.ok:
            errors[t.error or "unknown"] = errors.get(t.error or "unknown", 0) + 1
    dur = max(duration_s, 1e-9)
    out_tokens = sum(t.output_tokens for t in ok)
    in_tokens = sum(t.prompt_tokens for t in ok)
    good = sum(1 for t in ok if meets_slo(t, slo)) if slo else 0
    return RunStats(
        completed=len(ok), failed=len(timings) - len(ok), duration_s=duration_s,
        request_throughput=len(ok) / dur, output_throughput=out_tokens / dur,
        total_token_throughput=(in_tokens + out_tokens) / dur,
        goodput=(good / dur) if slo else None, good=good,
        ttft_ms=Summary.of(t.ttft for t in ok if t.ttft is not None).scaled(1000),
        tpot_ms=Summary.of(x for t in ok if (x := t.tpot) is not None).scaled(1000),
        itl_ms=Summary.of(g for t in ok for g in t.itls).scaled(1000),
        e2e_ms=Summary.of(t.e2e for t in ok).scaled(1000),
        total_input_tokens=in_tokens, total_output_tokens=out_tokens, errors=errors,
    )


def cdf_points(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their empirical CDF (i/n), for plotting."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]
