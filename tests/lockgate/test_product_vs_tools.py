"""Product vs tools: the wheel ships the product packages only, the benchmarks plug into the CLI
through the ``lockgate.commands`` entry point (the CLI never imports them), and where a tool is
absent (an install from the wheel) its command says so instead of a traceback."""

from __future__ import annotations

import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from setuptools import find_packages

import lockgate.cli as cli

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("benchmarks", "devtools", "tests", "scripts")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_wheel_ships_the_product_packages_and_no_tool() -> None:
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = set(find_packages(where=str(ROOT), include=include))
    assert {"bus", "edge", "producers", "engine_workers", "kv_store", "tokenization", "tracing", "lockgate"} <= shipped
    assert {"engine_workers.model.models", "engine_workers.model.loading", "engine_workers.model.execution"} <= shipped
    assert not [p for p in shipped if p.split(".")[0] in TOOLS], shipped
    assert not (ROOT / "lockgate" / "testing").exists()


def test_the_benchmarks_are_declared_as_a_cli_plugin() -> None:
    declared = _pyproject()["project"]["entry-points"][cli.PLUGIN_GROUP]
    assert declared == {"bench": "benchmarks.cli:register"}
    module, _, attr = declared["bench"].partition(":")
    assert callable(getattr(__import__(module, fromlist=[attr]), attr))


def _with_plugins(monkeypatch: pytest.MonkeyPatch, *values: str) -> None:
    eps = [EntryPoint(name=f"p{i}", value=v, group=cli.PLUGIN_GROUP) for i, v in enumerate(values)]
    monkeypatch.setattr(cli, "entry_points", lambda group: eps if group == cli.PLUGIN_GROUP else [])


def test_a_plugin_registers_its_bench_subcommands(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_plugins(monkeypatch, "benchmarks.cli:register")
    args = cli.build_parser().parse_args(["bench", "engine"])
    assert args.bench == "engine" and args.func is not cli._bench_missing


def _absent(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Imports of ``package`` fail as in an install from the wheel (ModuleNotFoundError naming it)."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


def test_without_the_benchmarks_bench_says_where_they_are(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    _with_plugins(monkeypatch, "benchmarks.cli:register")
    _absent(monkeypatch, "benchmarks")
    assert cli.main(["--log-level", "WARNING", "bench"]) == 2
    assert "the benchmarks are not installed: they run from a source checkout" in capsys.readouterr().err


def test_a_plugin_whose_own_dependency_is_missing_fails_loudly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "lg_broken_plugin.py").write_text("import lg_no_such_dependency\n\ndef register(sub, bench):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _with_plugins(monkeypatch, "lg_broken_plugin:register")
    with pytest.raises(ModuleNotFoundError) as exc:
        cli.build_parser()
    assert exc.value.name == "lg_no_such_dependency"


def test_a_dev_command_without_devtools_names_the_tool(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _absent(monkeypatch, "devtools")
    assert cli.main(["--log-level", "WARNING", "kafka", "status", "--dir", str(tmp_path)]) == 2
    assert "`lockgate kafka` is a development tool" in capsys.readouterr().err
    assert cli.main(["--log-level", "WARNING", "model", "tiny", str(tmp_path / "m")]) == 2
    assert "`lockgate model tiny` is a development tool" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_checkout_without_entry_points_passes_the_benchmarks_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m benchmarks`` (an uninstalled checkout: no entry points) and the installed entry
    point together register each bench subcommand once."""
    from benchmarks.cli import register

    _with_plugins(monkeypatch)
    assert cli.build_parser().parse_args(["bench"]).func is cli._bench_missing
    assert cli.build_parser((register,)).parse_args(["bench", "engine"]).bench == "engine"
    _with_plugins(monkeypatch, "benchmarks.cli:register")
    assert cli.build_parser((register,)).parse_args(["bench", "engine"]).bench == "engine"


def test_python_m_benchmarks_runs_the_cli_with_the_benchmarks() -> None:
    import subprocess

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "benchmarks", "bench", "engine", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage: lockgate bench engine" in run.stdout


def test_the_kafka_launcher_finds_the_checkout_it_lives_in() -> None:
    from devtools import kafka_local

    assert kafka_local.REPO == ROOT
    assert (kafka_local.REPO / "scripts" / "kafka" / "pom.xml").is_file()
