"""``python -m benchmarks.engine.lora`` runs end to end on the tiny model: a row per mode, each
with a positive median rate, its runs and its ratio to the base engine's, and the adapter load time."""

from __future__ import annotations

from benchmarks.engine.lora import run


def test_lora_bench_rows(tiny_model_dir) -> None:
    rows = run(tiny_model_dir, requests=3, rank=4, adapter_counts=[1, 2], repeat=2, threads=1, fp32_adapters=True)
    assert [r.get("adapters") for r in rows] == [0, 0, 1, 2, 1, 2, None]  # base, the engine, then float32 adapters
    assert all(r["tok_s"] > 0 and r["ratio"] > 0 and len(r["runs"]) == 2 for r in rows[:-1])
    assert "float32 adapters" in rows[-2]["mode"]
    assert rows[0]["ratio"] == 1.0 and rows[-1]["seconds"] > 0
