"""Pure tests: workload generators, percentiles, vLLM-style TPOT/ITL/goodput, SLO parsing, progress."""

from __future__ import annotations

import io
import math
import statistics

import pytest

from benchmarks.serving.loadgen import (
    LengthMix,
    arrival_times,
    parse_rates,
    sample_lengths,
    synthetic_text,
    workload,
)
from benchmarks.stats import (
    meets_slo,
    parse_slo,
    run_stats,
)
from producers.progress import ProgressBar, format_eta, render
from producers.timing import RequestTiming, Summary, percentile


def test_lengths_are_seeded_clipped_and_right_skewed():
    mix = LengthMix(prompt_max=600, output_max=300)
    a = sample_lengths(2000, mix, seed=1)
    assert a == sample_lengths(2000, mix, seed=1) and a != sample_lengths(2000, mix, seed=2)
    prompts = [p for p, _, _ in a]
    outs = [o for _, o, _ in a]
    assert min(prompts) >= mix.prompt_min and max(prompts) <= 600 and max(outs) <= 300
    assert statistics.mean(prompts) > statistics.median(prompts)  # long tail
    assert 90 < statistics.median(prompts) < 150
    tiers = [t for _, _, t in a]
    assert 0.5 < tiers.count(1) / len(tiers) < 0.7


def test_arrivals_mean_rate_and_burstiness():
    for kind in ("poisson", "bursty"):
        ts = arrival_times(5000, 4.0, kind, seed=3)
        assert ts[0] == 0 and all(b >= a for a, b in zip(ts, ts[1:]))
        assert 3.6 < (len(ts) - 1) / ts[-1] < 4.4

    def gaps(kind: str) -> list[float]:
        t = arrival_times(5000, 4.0, kind, seed=3)
        return [b - a for a, b in zip(t, t[1:])]

    def cv(g: list[float]) -> float:
        return statistics.pstdev(g) / statistics.mean(g)

    assert 0.9 < cv(gaps("poisson")) < 1.1 and cv(gaps("bursty")) > 1.5
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, "uniform")
    w = workload(10, 2.0, LengthMix(), seed=5)
    assert [r.prompt_len for r in w] == [r.prompt_len for r in workload(10, 8.0, LengthMix(), seed=5)]
    assert parse_rates("1, 2,inf") == [1.0, 2.0, math.inf]
    assert synthetic_text(5, 1) == synthetic_text(5, 1) and len(synthetic_text(5, 1).split()) == 5


def test_percentile_matches_numpy_linear():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0 and percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([1.0, 2.0], 25) == pytest.approx(1.25)
    assert math.isnan(percentile([], 50))
    s = Summary.of([1.0, 2.0, 3.0])
    assert (s.mean, s.median, s.count) == (2.0, 2.0, 3)


def test_vllm_definitions_and_goodput():
    # sent at 0; chunks at 0.1, 0.15, 0.3; done at 0.3 with 4 tokens (the last chunk carried 2)
    t = RequestTiming(0.0, (0.1, 0.15, 0.3), 0.3, 4, 10, 1)
    assert t.ttft == pytest.approx(0.1) and t.e2e == pytest.approx(0.3)
    assert t.tpot == pytest.approx((0.3 - 0.1) / 3)
    assert t.itls == pytest.approx((0.05, 0.15))
    one = RequestTiming(0.0, (0.2,), 0.2, 1)
    assert one.tpot is None
    slo = parse_slo("ttft=150ms,tpot=0.1s")
    assert slo == {"ttft": 0.15, "tpot": 0.1}
    assert meets_slo(t, slo) and meets_slo(one, {"tpot": 0.001}) and not meets_slo(one, slo)
    bad = RequestTiming(0.0, (), 1.0, 0, ok=False, error="overloaded")
    st = run_stats([t, one, bad], duration_s=2.0, slo=slo)
    assert (st.completed, st.failed, st.good) == (2, 1, 1)
    assert st.goodput == pytest.approx(0.5) and st.request_throughput == pytest.approx(1.0)
    assert st.output_throughput == pytest.approx(2.5) and st.errors == {"overloaded": 1}
    assert st.ttft_ms.mean == pytest.approx(150.0) and st.tpot_ms.count == 1
    assert run_stats([t], 1.0).goodput is None
    for bad_slo in ("ttft", "foo=1ms", "ttft=-1ms", "ttft=abc"):
        with pytest.raises(ValueError):
            parse_slo(bad_slo)


def test_progress_line():
    assert format_eta(3725) == "1:02:05" and format_eta(None) == "--:--"
    line = render(done=5, total=10, tokens=100, elapsed=10.0, done_at_start=0)
    assert "5/10" in line and "10.0 tok/s" in line and "ETA 00:10" in line
    clock = iter([0.0, 1.0, 2.0, 3.0, 4.0]).__next__
    out = io.StringIO()
    bar = ProgressBar(4, 2, stream=out, clock=clock, log_every_s=0.0)
    bar.update(1, 10)
    bar.close()
    assert out.getvalue().count("\n") == 2 and "3/4" in out.getvalue() and "4/4" not in out.getvalue()
