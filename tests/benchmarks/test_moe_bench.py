"""``lockgate bench moe`` on a tiny shape: every peer measured at every batch size, and the grouped
layer checked against transformers' block on the same weights before it is timed."""

from __future__ import annotations

from benchmarks.engine.moe import MoeShape, bench_block


def test_bench_block_measures_every_peer():
    rows = bench_block(MoeShape(hidden=32, inter=16, experts=4, top_k=2), (1, 9), rounds=1)
    assert [r.tokens for r in rows] == [1, 9]
    for r in rows:
        assert set(r.ms) == {"grouped", "hf", "dense"}
        assert all(0 < v < 1e4 for v in r.ms.values())
