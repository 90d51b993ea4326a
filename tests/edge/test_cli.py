"""`lockgate keys add`, `lockgate edge --help`, `lockgate bench edge --help`."""

from __future__ import annotations

import json

import pytest

from edge.config import hash_key, load_keys
from engine_workers.cli import build_parser, main


def test_keys_add_appends_hashed(tmp_path, capsys):
    path = tmp_path / "keys.jsonl"
    assert main(["keys", "add", "--tenant", "acme", "--tier", "0", "--keys", str(path)]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("lg-") and key not in path.read_text()
    assert load_keys(path)[hash_key(key)].tier == 0


def test_keys_add_prints_entry_without_file(capsys):
    assert main(["keys", "add", "--tenant", "t"]) == 0
    key, line = capsys.readouterr().out.strip().splitlines()
    assert json.loads(line)["sha256"] == hash_key(key)


@pytest.mark.parametrize("argv", [["edge", "--help"], ["bench", "edge", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(argv)
    assert ei.value.code == 0
    assert "--" in capsys.readouterr().out
