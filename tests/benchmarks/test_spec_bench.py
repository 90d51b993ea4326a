"""``lockgate bench spec`` on the tiny model: both modes measured at each batch size, the tokens
compared between them, and the command registered under ``lockgate bench``."""

from __future__ import annotations

import argparse

from benchmarks.engine.spec import add_args, run_bench


def test_bench_spec_measures_both_modes_and_compares_tokens(tiny_model_dir):
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--model", tiny_model_dir, "--batches", "1,2", "--max-tokens", "12", "--repeat", "1",
                         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                 '"prompt_lookup_min": 1, "prompt_lookup_max": 2}'])
    rows = run_bench(args)
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "plain"), (1, "ngram"), (2, "plain"), (2, "ngram")]
    for r in rows:
        assert r["identical"] is True
        assert r["generated"] == 12 * r["batch"] and r["tok_s"] > 0
        if r["mode"] == "ngram":
            assert 0.0 <= r["acceptance_rate"] <= 1.0 and r["tokens_per_verification"] >= 1.0


def test_bench_spec_is_a_lockgate_bench_subcommand():
    from lockgate.cli import build_parser

    args = build_parser().parse_args(["bench", "spec", "--batches", "1", "--max-tokens", "4"])
    assert args.batches == "1" and args.max_tokens == 4 and callable(args.func)


def test_bench_spec_draft_model_case_on_the_chat_workload(tiny_model_dir):
    """--draft-layers 1: the tiny target's first layer as the draft; tokens still identical."""
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--model", tiny_model_dir, "--batches", "1", "--max-tokens", "10", "--repeat", "1",
                         "--workload", "chat", "--draft-layers", "1"])
    rows = run_bench(args)
    assert [(r["batch"], r["workload"], r["mode"]) for r in rows] == [(1, "chat", "plain"), (1, "chat", "draft_model")]
    assert all(r["identical"] is True for r in rows) and rows[1]["drafts"] > 0


def test_bench_spec_truncated_draft_refuses_a_bad_layer_count(tiny_model_dir, tmp_path):
    import pytest

    from benchmarks.engine.spec import truncated_draft

    with pytest.raises(ValueError, match="--draft-layers"):
        truncated_draft(tiny_model_dir, 2, tmp_path / "d")
