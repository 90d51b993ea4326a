"""bench serve on the tiny model (embedded edge + worker + memory bus): JSON and PNGs."""

from __future__ import annotations

import json

from benchmarks.cli import parse_keys
from benchmarks.serving.loadgen import LengthMix
from benchmarks.serving.serve import BenchConfig, bench, format_table
from benchmarks.stats import parse_slo
from engine_workers.engine.config import EngineConfig
from tests.producers.conftest import fake_worker_mode


def test_parse_keys():
    assert parse_keys([]) == {1: None}
    assert parse_keys(["p0:k0", "k1", "k2"]) == {0: "k0", 1: "k1", 2: "k2"}


async def test_bench_serve_tiny_embedded(tiny_model_dir, tmp_path):
    tiny_model = tiny_model_dir
    mix = LengthMix(prompt_median=24, prompt_max=64, output_median=8, output_max=16, output_min=2)
    cfg = BenchConfig(target="embedded", rates=(8.0, 32.0), num_prompts=12, out_dir=tmp_path / "out",
                      model=str(tiny_model), seed=1, slo=parse_slo("ttft=2s,tpot=500ms"), mix=mix,
                      connections_per_tier=2, request_timeout_s=60, fake_worker=fake_worker_mode(),
                      engine=EngineConfig(model=str(tiny_model), device="cpu", num_threads=1, kv_cache_bytes=8 << 20))
    result = await bench(cfg)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["rate"] for r in saved["runs"]] == [8.0, 32.0]
    for run in saved["runs"]:
        s = run["stats"]
        assert s["completed"] == 12 and s["failed"] == 0, s["errors"]
        assert s["total_output_tokens"] == sum(r["output_tokens"] for r in run["requests"])
        assert all(s[k]["p99"] >= s[k]["median"] > 0 for k in ("ttft_ms", "e2e_ms"))
        assert s["goodput"] is not None and s["request_throughput"] > 0
        assert set(run["by_tier"]) <= {"p0", "p1", "p2"} and len(run["by_tier"]) >= 2
        # every request produced exactly its sampled output length (ignore_eos)
        assert all(2 <= r["output_tokens"] <= 16 for r in run["requests"])
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert pngs == ["latency_cdf_rate-32.png", "latency_cdf_rate-8.png", "throughput_vs_rate.png"]
    assert all((tmp_path / "out" / p).stat().st_size > 10_000 for p in pngs)
    assert "TTFT" in format_table(result)
