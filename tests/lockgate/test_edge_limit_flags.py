"""The edge's limit flags (lockgate/edge_options.py) exist on both `lockgate edge` and `lockgate serve`,
reach EdgeConfig, have env twins, and default to EdgeConfig's own defaults."""

from __future__ import annotations

import argparse

import pytest

from edge.config import ConfigError, EdgeConfig
from lockgate import serve
from lockgate.commands import edge
from lockgate.edge_options import edge_limits


def _parse(module, command: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.register(parser.add_subparsers(), None)
    return parser.parse_args([command, *argv])


@pytest.mark.parametrize(("module", "command"), [(edge, "edge"), (serve, "serve")])
def test_flags_reach_the_edge_config(module, command: str) -> None:
    args = _parse(module, command, ["--publish-timeout", "1.5", "--max-connections-per-key", "3",
                                    "--grammar-compile-timeout", "0.25", "--no-fleet-limits",
                                    "--fleet-sync-interval", "0.2", "--fleet-edge-stale", "1.5"])
    cfg = EdgeConfig(model="m", **edge_limits(args))
    assert (cfg.publish_timeout_s, cfg.max_connections_per_key, cfg.grammar_compile_timeout_s) == (1.5, 3, 0.25)
    assert (cfg.fleet_limits, cfg.fleet_sync_interval_s, cfg.fleet_edge_stale_s) == (False, 0.2, 1.5)


@pytest.mark.parametrize(("module", "command"), [(edge, "edge"), (serve, "serve")])
def test_defaults_are_the_configs(module, command: str) -> None:
    cfg, ref = EdgeConfig(model="m", **edge_limits(_parse(module, command, []))), EdgeConfig(model="m")
    assert (cfg.publish_timeout_s, cfg.max_connections_per_key, cfg.grammar_compile_timeout_s) == (
        ref.publish_timeout_s, ref.max_connections_per_key, ref.grammar_compile_timeout_s)
    assert (cfg.fleet_limits, cfg.fleet_sync_interval_s, cfg.fleet_edge_stale_s) == (
        ref.fleet_limits, ref.fleet_sync_interval_s, ref.fleet_edge_stale_s)


def test_env_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKGATE_PUBLISH_TIMEOUT", "2")
    monkeypatch.setenv("LOCKGATE_MAX_CONNECTIONS_PER_KEY", "0")
    monkeypatch.setenv("LOCKGATE_GRAMMAR_COMPILE_TIMEOUT", "9")
    monkeypatch.setenv("LOCKGATE_FLEET_LIMITS", "0")
    monkeypatch.setenv("LOCKGATE_FLEET_SYNC_INTERVAL", "0.25")
    monkeypatch.setenv("LOCKGATE_FLEET_EDGE_STALE", "4")
    limits = edge_limits(_parse(serve, "serve", []))
    assert limits == {"publish_timeout_s": 2.0, "max_connections_per_key": 0, "grammar_compile_timeout_s": 9.0,
                      "fleet_limits": False, "fleet_sync_interval_s": 0.25, "fleet_edge_stale_s": 4.0}


def test_a_bad_value_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="publish_timeout_s"):
        EdgeConfig(model="m", **edge_limits(_parse(serve, "serve", ["--publish-timeout", "0"])))
