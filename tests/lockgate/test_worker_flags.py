"""The worker's flag table (lockgate/worker_flags.py): `lockgate worker` and `lockgate serve` take the
same worker flags, each reaches its WorkerConfig field, the env twins work, and a default in the
table is the config's own default."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from engine_workers.worker.config import WorkerConfig
from engine_workers.worker.intake.queue import IntakeMode
from lockgate import serve
from lockgate.commands import worker
from lockgate.worker_flags import WORKER_FLAGS, worker_config_from_args


def _parser(module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    module.register(sub, None)
    return parser


def _parse(module, command: str, argv: list[str]) -> argparse.Namespace:
    return _parser(module).parse_args([command, *argv])


def _options(module, command: str) -> set[str]:
    sub = next(a for a in _parser(module)._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in sub.choices[command]._actions for o in a.option_strings}


def test_every_row_names_a_real_config_field_and_its_default() -> None:
    fields = {f.name: f for f in dataclasses.fields(WorkerConfig)}
    assert len({f.flag for f in WORKER_FLAGS}) == len(WORKER_FLAGS)
    for row in WORKER_FLAGS:
        if row.field is None or row.field == "worker_id":
            continue
        assert row.field in fields, row
        assert row.default == fields[row.field].default, (row.flag, row.default, fields[row.field].default)


def test_serve_and_worker_take_the_same_worker_flags() -> None:
    table = {f"--{f.flag}" for f in WORKER_FLAGS} | {"--no-fair-share"}
    assert table <= _options(worker, "worker")
    assert table <= _options(serve, "serve")  # serve gained fair share, prefetch, commit interval, ...


@pytest.mark.parametrize(("module", "command"), [(worker, "worker"), (serve, "serve")])
def test_flags_reach_the_config(module, command: str) -> None:
    args = _parse(module, command, ["--no-fair-share", "--intake-mode", "strict", "--aging-period", "0.5",
                                    "--prefetch-per-tier", "7", "--commit-interval", "0", "--age-credit-periods", "3",
                                    "--namespace", "ns1", "--partitions", "2", "--worker-id", "w-9",
                                    "--served-model-name", "served"])
    cfg = worker_config_from_args(args, "loaded-model")
    assert cfg.fair_share is False and cfg.intake_mode is IntakeMode.STRICT
    assert (cfg.aging_period_s, cfg.prefetch_per_tier, cfg.commit_interval_s, cfg.age_credit_periods) == (0.5, 7, 0.0, 3.0)
    assert (cfg.layout.namespace, cfg.layout.partitions, cfg.worker_id, cfg.model) == ("ns1", 2, "w-9", "served")


def test_defaults_give_the_default_config() -> None:
    cfg = worker_config_from_args(_parse(serve, "serve", []), "m")
    ref = WorkerConfig("m")
    for row in WORKER_FLAGS:
        if row.field not in (None, "worker_id"):
            assert getattr(cfg, row.field) == getattr(ref, row.field), row.flag
    assert cfg.model == "m" and cfg.worker_id.startswith("worker-")


def test_env_twins_set_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKGATE_FAIR_SHARE", "false")
    monkeypatch.setenv("LOCKGATE_PREFETCH_PER_TIER", "9")
    monkeypatch.setenv("LOCKGATE_AGE_CREDIT_PERIODS", "1.5")
    cfg = worker_config_from_args(_parse(serve, "serve", []), "m")
    assert (cfg.fair_share, cfg.prefetch_per_tier, cfg.age_credit_periods) == (False, 9, 1.5)


def test_a_bad_value_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(worker, "worker", ["--prefetch-per-tier", "many"])
    assert "--prefetch-per-tier" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prefetch_per_tier"):
        worker_config_from_args(_parse(serve, "serve", ["--prefetch-per-tier", "0"]), "m")
