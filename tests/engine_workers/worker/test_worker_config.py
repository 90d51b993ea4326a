"""WorkerConfig (engine_workers/worker/config.py): a bad setting fails when built, naming the field."""

from __future__ import annotations

import pytest

from bus import TopicLayout
from engine_workers.worker.config import WorkerConfig
from engine_workers.worker.intake.queue import IntakeMode


def test_defaults_and_the_group_name() -> None:
    cfg = WorkerConfig("SmolLM2/135M", layout=TopicLayout(namespace="ns"))
    assert cfg.intake_mode is IntakeMode.AGING
    assert cfg.worker_id.startswith("worker-") and cfg.worker_id != WorkerConfig("m").worker_id
    assert cfg.group.startswith("ns.workers.") and "/" not in cfg.group  # topic-safe model name
    assert WorkerConfig("m", group_id="mine").group == "mine"


def test_intake_mode_given_as_text_becomes_the_enum() -> None:
    assert WorkerConfig("m", intake_mode="strict").intake_mode is IntakeMode.STRICT


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"heartbeat_s": -1}, "heartbeat_s"),
    ({"drain_grace_s": float("nan")}, "drain_grace_s"),
    ({"revoke_flush_s": -0.5}, "revoke_flush_s"),
    ({"commit_interval_s": -1}, "commit_interval_s"),
    ({"prefetch_per_tier": 0}, "prefetch_per_tier"),
    ({"intake_mode": "lottery"}, "lottery"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WorkerConfig("m", **kwargs)


def test_help_shows_each_default_as_it_applies(monkeypatch, capsys) -> None:
    """`lockgate worker --help` names every flag's default, and a LOCKGATE_* variable is that default."""
    import pytest

    from lockgate.cli import build_parser

    def help_text() -> str:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["worker", "--help"])
        return " ".join(capsys.readouterr().out.split())  # argparse wraps lines

    text = help_text()
    assert "[LOCKGATE_COMMIT_INTERVAL] (default: 1.0)" in text and "(default: aging)" in text
    assert "--no-prefix-caching disable automatic prefix caching [LOCKGATE_NO_PREFIX_CACHING] --threads" in text
    monkeypatch.setenv("LOCKGATE_COMMIT_INTERVAL", "2.5")
    assert "[LOCKGATE_COMMIT_INTERVAL] (default: 2.5)" in help_text()
