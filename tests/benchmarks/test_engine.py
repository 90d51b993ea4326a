"""`lockgate bench engine` on the tiny model: every engine runs the whole workload, --repeat keeps
each one's best, and the FLOP count behind the roofline share is the model's exact work."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.engine import model_flops
from lockgate.cli import build_parser


def _bench_json(capsys) -> dict:
    text = capsys.readouterr().out
    return json.loads(text[text.index("{"):])


def test_bench_engine_keeps_best_of_rounds(tiny_model_dir, capsys):
    args = build_parser().parse_args(["bench", "engine", "--model", tiny_model_dir, "--kv-cache-bytes", "16M",
                                      "--num-requests", "6", "--repeat", "2", "--skip-hf", "--json"])
    assert args.func(args) == 0
    out = _bench_json(capsys)
    assert out["repeat"] == 2
    runs = out["lockgate"]["all_seconds"]
    assert len(runs) == 2 and out["lockgate"]["seconds"] == min(runs)
    assert set(out["gemm_flops_by_path"]) >= {"torch_mm"}
    assert out["gemm_flops"] == max(out["gemm_flops_by_path"].values())
    # every round computes every prompt: no round is made cheaper by an earlier round's prefix cache
    assert out["lockgate"]["computed_tokens"] == out["prompt_tokens"] + out["output_tokens"] - out["requests"]
    share = out["lockgate"]["roofline_share"]
    assert 0 < share == pytest.approx(out["lockgate"]["model_flops_per_s"] / out["gemm_flops"])


def test_bench_engine_compares_with_both_hf_modes(tiny_model_dir, capsys):
    args = build_parser().parse_args(["bench", "engine", "--model", tiny_model_dir, "--kv-cache-bytes", "16M",
                                      "--num-requests", "4", "--json"])
    assert args.func(args) == 0
    out = _bench_json(capsys)
    for key in ("hf_static_b8", "hf_continuous"):
        assert len(out[key]["all_seconds"]) == 1 and out[key]["seconds"] > 0
        assert out[f"speedup_vs_{key}"] == pytest.approx(out[key]["seconds"] / out["lockgate"]["seconds"])


def test_bench_engine_rejects_repeat_below_one(tiny_model_dir):
    args = build_parser().parse_args(["bench", "engine", "--model", tiny_model_dir, "--repeat", "0", "--skip-hf"])
    with pytest.raises(ValueError, match="--repeat"):
        args.func(args)


def test_model_flops_counts_attention_exactly():
    spec = SimpleNamespace(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=2, intermediate_size=16,
                           num_layers=3, vocab_size=100)
    per_layer = 2 * 8 * (4 + 2 * 2) * 2 + 2 * 4 * 2 * 8 + 2 * 3 * 8 * 16
    # one sequence of final length 4 computes positions 0..2, attending to 1, 2 and 3 keys
    want = 3 * 3 * per_layer + 4 * 4 * 2 * (1 + 2 + 3) * 3 + 1 * 2 * 8 * 100
    assert model_flops(spec, computed_tokens=3, sampled_tokens=1, seq_lens=[4]) == want
