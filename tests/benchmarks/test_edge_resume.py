"""``lockgate bench edge-resume`` on the tiny model and a broker of the test's own: one kill, figures printed."""

from __future__ import annotations

import json
import os

import pytest

from lockgate.cli import build_parser

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(400)]


def test_bench_edge_resume_reports_the_resume_time_and_the_store_cost(tiny_model_dir, private_kafka, tmp_path,
                                                                      capsys):
    model = tmp_path / "tiny"  # the edge serves the folder's name, the worker is told the same
    model.symlink_to(tiny_model_dir)
    args = build_parser().parse_args(["bench", "edge-resume", "--bus", f"kafka://{private_kafka.bootstrap}",
                                      "--model", str(model), "--kills", "1", "--requests", "2", "--max-tokens", "400",
                                      "--kill-after", "1", "--logs", str(tmp_path / "logs"), "--json"])
    assert args.func(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["kills"] == 1 and 0 < res["resume_p50_s"] <= res["resume_max_s"] < 60
    assert res["store_p50_ms"] > 0 and res["no_store_p50_ms"] > 0
    assert os.path.isdir(tmp_path / "logs")


def test_bench_edge_resume_refuses_bad_counts(tiny_model_dir):
    args = build_parser().parse_args(["bench", "edge-resume", "--model", tiny_model_dir, "--kills", "0"])
    with pytest.raises(ValueError, match="--kills"):
        args.func(args)
