"""``lockgate bench decode`` (benchmarks/engine/decode_attention.py): every peer timed on the same inputs,
each checked against gather + SDPA first, so a wrong kernel cannot produce a figure."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.engine.decode_attention import Shape, format_table, measure
from engine_workers.kernels import cpu_kernels

SMALL = Shape(heads=4, kv_heads=2, head_size=64, layers=2, block_size=16)
CASES = (("3 mixed", (1, 130, 40)), ("1 x 300", (300,)))


@pytest.fixture
def peers() -> dict:
    split, loop = cpu_kernels.paged_decode(), cpu_kernels.paged_decode_loop()
    if split is None or loop is None:
        pytest.skip(f"no CPU decode kernel here: {cpu_kernels.problem()}")
    return {"split": split, "loop": loop, "sdpa": cpu_kernels.reference_decode}


def test_every_peer_is_timed_per_case_and_dtype(peers: dict) -> None:
    rows = measure(peers, SMALL, cases=CASES, rounds=1, steps=1)
    assert [(r.case, r.kv_dtype, r.tokens) for r in rows] == [
        ("3 mixed", "float32", 171), ("3 mixed", "bfloat16", 171), ("1 x 300", "float32", 300), ("1 x 300", "bfloat16", 300)]
    for r in rows:
        assert set(r.ms_per_layer) == {"split", "loop", "sdpa"} and all(v > 0 for v in r.ms_per_layer.values())
        assert all(v > 0 for v in r.gb_per_s.values())
    table = format_table(rows, list(peers))
    assert table.count("\n") == 1 + len(rows) and "loop / split" in table and "sdpa / split" in table


def test_a_wrong_peer_is_refused_before_it_is_timed(peers: dict) -> None:
    wrong = {**peers, "loop": lambda *a: peers["loop"](*a) * 1.01}
    with pytest.raises(AssertionError, match="loop"):
        measure(wrong, SMALL, cases=CASES[:1], kv_dtypes=("float32",), rounds=1, steps=1)


def test_command_prints_json_with_the_machine(peers: dict, capsys: pytest.CaptureFixture[str]) -> None:
    from lockgate.cli import build_parser

    args = build_parser().parse_args(["bench", "decode", "--layers", "1", "--rounds", "1", "--steps", "1",
                                      "--no-sdpa", "--threads", str(torch.get_num_threads()), "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["machine"]["cpu_model"] and out["shape"]["heads"] == 9 and len(out["rows"]) == 10
    assert all(set(r["ms_per_layer"]) == {"split", "loop"} for r in out["rows"])
