"""``lockgate edge`` start-up messages (no edge is run: the event loop is stubbed)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest


@pytest.mark.parametrize("reuse_port", [True, False])
def test_reuse_port_warns_that_limits_are_per_process(tiny_model_dir: str, tmp_path: Path, reuse_port: bool,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from edge.config import add_key
    from lockgate.commands import edge as cmd

    keys = tmp_path / "keys.jsonl"
    add_key(keys, "acme", 1, weight=2.0)
    monkeypatch.setattr(cmd, "run_loop", lambda coro: coro.close())  # parse and configure only
    parser = argparse.ArgumentParser()
    cmd.register(parser.add_subparsers(), None)  # type: ignore[arg-type]  # bench parsers unused
    argv = ["edge", "--model", str(tiny_model_dir), "--keys", str(keys)] + (["--reuse-port"] if reuse_port else [])
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    err = capsys.readouterr().err
    assert ("per edge process" in err and "N x its limits" in err) == reuse_port
