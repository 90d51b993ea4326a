"""``python -m benchmarks.engine.lora`` runs end to end on the tiny model: a row per mode, each
with a positive rate and its ratio to the base engine's, and the adapter load time."""

from __future__ import annotations

from benchmarks.engine.lora import run


def test_lora_bench_rows(tiny_model_dir) -> None:
    rows = run(tiny_model_dir, requests=3, rank=4, adapter_counts=[1, 2], repeat=1, threads=1)
    assert [r.get("adapters") for r in rows] == [0, 0, 1, 2, 2, None]  # 2 adapters: grouped path, then segments only
    assert all(r["tok_s"] > 0 and r["ratio"] > 0 for r in rows[:-1])
    assert rows[0]["ratio"] == 1.0 and rows[-1]["seconds"] > 0
