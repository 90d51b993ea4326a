"""``lockgate edge`` start-up messages (no edge is run: the event loop is stubbed)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest


@pytest.mark.parametrize("reuse_port", [True, False])
def test_reuse_port_with_acknowledged_per_process_limits_warns(tiny_model_dir: str, tmp_path: Path, reuse_port: bool,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from edge.config import add_key
    from lockgate.commands import edge as cmd

    keys = tmp_path / "keys.jsonl"
    add_key(keys, "acme", 1, weight=2.0)
    monkeypatch.setattr(cmd, "run_loop", lambda coro: coro.close())  # parse and configure only
    parser = argparse.ArgumentParser()
    cmd.register(parser.add_subparsers(), None)  # type: ignore[arg-type]  # bench parsers unused
    argv = ["edge", "--model", str(tiny_model_dir), "--keys", str(keys)] + \
        (["--reuse-port", "--no-fleet-limits", "--limits-per-process"] if reuse_port else [])
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    err = capsys.readouterr().err
    assert ("per edge process" in err and "N x its limits" in err) == reuse_port


def test_reuse_port_with_a_key_file_is_refused_unless_per_process_limits_are_accepted(
        tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edge.config import add_key
    from lockgate.commands import edge as cmd

    keys = tmp_path / "keys.jsonl"
    add_key(keys, "acme", 1)
    monkeypatch.setattr(cmd, "run_loop", lambda coro: coro.close())  # parse and configure only
    parser = argparse.ArgumentParser()
    cmd.register(parser.add_subparsers(), None)  # type: ignore[arg-type]  # bench parsers unused
    args = parser.parse_args(["edge", "--model", str(tiny_model_dir), "--keys", str(keys), "--reuse-port",
                              "--no-fleet-limits"])
    with pytest.raises(ValueError, match="--limits-per-process"):
        args.func(args)


def test_reuse_port_with_fleet_limits_needs_no_acknowledgement(tiny_model_dir: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Fleet-wide limits (the default) share each key's limits over the processes: nothing multiplies."""
    from edge.config import add_key
    from lockgate.commands import edge as cmd

    keys = tmp_path / "keys.jsonl"
    add_key(keys, "acme", 1)
    monkeypatch.setattr(cmd, "run_loop", lambda coro: coro.close())  # parse and configure only
    parser = argparse.ArgumentParser()
    cmd.register(parser.add_subparsers(), None)  # type: ignore[arg-type]  # bench parsers unused
    args = parser.parse_args(["edge", "--model", str(tiny_model_dir), "--keys", str(keys), "--reuse-port",
                              "--fleet-sync-interval", "0.25", "--fleet-edge-stale", "2"])
    assert args.func(args) == 0
    assert "N x its limits" not in capsys.readouterr().err
    assert args.fleet_limits is True and args.fleet_sync_interval == 0.25 and args.fleet_edge_stale == 2.0
