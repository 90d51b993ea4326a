"""``lockgate bench recovery`` on the tiny model and the local broker: one kill, figures printed."""

from __future__ import annotations

import json

import pytest

from lockgate.cli import build_parser

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]


def test_bench_recovery_reports_the_gap_and_no_rerun_steps(tiny_model_dir, kafka_bootstrap, tmp_path, capsys):
    url = f"kafka://{kafka_bootstrap}?session_timeout_ms=6000&heartbeat_interval_ms=500"
    args = build_parser().parse_args(["bench", "recovery", "--bus", url, "--model", tiny_model_dir, "--kills", "1",
                                      "--requests", "4", "--max-tokens", "64", "--kv-cache-bytes", "4M",
                                      "--logs", str(tmp_path), "--json"])
    assert args.func(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["kills"] == 1 and res["taken_over"] >= 1 and res["samples"] == res["taken_over"]
    assert res["rerun_steps"] == 0
    assert 0 < res["recovery_p50_s"] <= res["recovery_p99_s"] < 60
    # the streams as the edge delivers them: no gap, no splice, each equal to a local reference run
    assert res["gaps"] == 0 and res["spliced"] == 0
    assert res["exact"] == res["exact_of"] == res["taken_over"]


def test_bench_recovery_sigstop_variant_fences_the_paused_worker(tiny_model_dir, kafka_bootstrap, tmp_path, capsys):
    """--signal stop: the paused worker's streams are taken over (group defaults: the 10 s session
    timeout is not waited for), it continues, and the client's streams stay exact."""
    args = build_parser().parse_args(["bench", "recovery", "--bus", f"kafka://{kafka_bootstrap}", "--model", tiny_model_dir,
                                      "--kills", "1", "--signal", "stop", "--requests", "4", "--max-tokens", "64",
                                      "--kv-cache-bytes", "4M", "--logs", str(tmp_path), "--json"])
    assert args.func(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["kills"] == 1 and res["taken_over"] >= 1
    assert res["gaps"] == 0 and res["spliced"] == 0
    assert res["exact"] == res["exact_of"] == res["taken_over"]
    assert 0 < res["recovery_max_s"] < 9  # the takeover, not a rebalance after the victim's session timed out


def test_bench_recovery_refuses_bad_counts(tiny_model_dir):
    args = build_parser().parse_args(["bench", "recovery", "--model", tiny_model_dir, "--kills", "0"])
    with pytest.raises(ValueError, match="--kills"):
        args.func(args)
    args = build_parser().parse_args(["bench", "recovery", "--model", tiny_model_dir, "--signal", "stop", "--pause", "12"])
    with pytest.raises(ValueError, match="--pause"):
        args.func(args)
