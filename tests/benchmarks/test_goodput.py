"""`lockgate bench goodput`'s own arithmetic (no servers): what it keeps of a vLLM result, the
share of requests that met the SLO, the lockgate/vLLM ratios per rate, and vLLM's client command."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.serving.goodput import _bench_cmd, add_args, ratios, summarize


def raw(rate: float, goodput: float, completed: int = 10, duration: float = 10.0) -> dict:
    out = {"request_rate": rate, "completed": completed, "failed": 0, "duration": duration,
           "request_throughput": completed / duration, "request_goodput": goodput, "output_throughput": 99.0,
           "per_request_ttfts": [0.1] * completed}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            out[f"{stat}_{metric}_ms"] = 1.0
    return out


def test_summarize_keeps_the_figures_and_the_share_of_good_requests() -> None:
    row = summarize(raw(2.0, goodput=0.6), 1.5, 2.5)
    assert row["good_share"] == pytest.approx(0.6)  # 6 of 10 requests met both targets
    assert row["load_1m"] == [1.5, 2.5] and row["p99_tpot_ms"] == 1.0
    assert "per_request_ttfts" not in row  # no per-request arrays in the summary


def test_ratios_per_rate_and_none_where_vllm_had_no_goodput() -> None:
    rows = {"lockgate": [summarize(raw(r, g), 0, 0) for r, g in ((1.0, 1.0), (2.0, 0.5))],
            "vllm": [summarize(raw(r, g), 0, 0) for r, g in ((1.0, 0.5), (2.0, 0.0), (4.0, 0.1))]}
    got = ratios(rows)
    assert [q["rate"] for q in got] == [1.0, 2.0]  # only the rates both were measured at
    assert got[0]["ratio"] == pytest.approx(2.0) and got[1]["ratio"] is None


def test_the_client_command_carries_the_slo_the_tier_and_the_concurrency() -> None:
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--vllm-cli", "vllm", "--input-len", "128"])
    cmd = _bench_cmd(args, "http://h:1", "m", Path("/tmp/x/r.json"), rate=float("inf"), n=5,
                     body={"priority": 2}, concurrency=8)
    text = " ".join(cmd)
    assert cmd[:3] == ["vllm", "bench", "serve"]
    assert "--goodput ttft:500 tpot:50" in text and "--request-rate inf" in text
    assert '--extra-body {"priority": 2}' in text and "--max-concurrency 8" in text
    assert "--random-input-len 128" in text and "--ignore-eos" in text
