"""``lockgate edge --models NAME=MODEL ...`` (more base models behind one edge, docs/lora.md) and
its env twin; ``lockgate keys add --admin`` and the key file's ``admin`` field."""

from __future__ import annotations

import argparse

import pytest

from edge.config import ConfigError, EdgeConfig, parse_keys
from lockgate.commands import edge


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    edge.register(parser.add_subparsers(), None)
    return parser.parse_args(argv)


def test_models_flag_and_env_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parse(["edge"]).models == []
    assert _parse(["edge", "--models", "a=/m/a", "b=/m/b"]).models == ["a=/m/a", "b=/m/b"]
    monkeypatch.setenv("LOCKGATE_MODELS", "q=/m/q r=/m/r")
    assert _parse(["edge"]).models == ["q=/m/q", "r=/m/r"]


def test_models_config_is_checked() -> None:
    assert EdgeConfig(model="m", models=(("q", "/m/q"),)).models == (("q", "/m/q"),)
    with pytest.raises(ConfigError, match="models"):
        EdgeConfig(model="m", models=(("m", "/m/m"),))  # the edge's own model again
    with pytest.raises(ConfigError, match="models"):
        EdgeConfig(model="m", models=(("q", ""),))


def test_admin_keys(tmp_path) -> None:
    args = _parse(["keys", "add", "--tenant", "ops", "--admin", "--keys", str(tmp_path / "k.jsonl")])
    assert args.admin
    assert args.func(args) == 0
    (entry,) = parse_keys((tmp_path / "k.jsonl").read_text()).values()
    assert entry.admin and entry.tenant == "ops"
    plain = '{"sha256": "' + "a" * 64 + '", "tenant": "t"}'
    assert not next(iter(parse_keys(plain).values())).admin
    with pytest.raises(ConfigError, match="admin"):
        parse_keys('{"sha256": "' + "b" * 64 + '", "tenant": "t", "admin": "yes"}')
