"""``--log-format json`` (env LOCKGATE_LOG_FORMAT): one JSON object per line, with request and
trace ids where the code logging knows them."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bus import REQUEST_ID, bound
from lockgate.logformat import JsonFormatter, configure

ROOT = Path(__file__).resolve().parents[2]


def _capture(name: str) -> tuple[logging.Logger, io.StringIO, logging.Handler]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    return logger, out, handler


def test_json_lines_carry_the_fields_and_the_bound_ids_per_task() -> None:
    logger, out, handler = _capture("lockgate.test.json")
    try:
        async def one(rid: str, started: asyncio.Event, other: asyncio.Event) -> None:
            with bound(rid, trace_id=f"trace-{rid}"):
                started.set()
                await other.wait()  # both tasks are inside their block at once
                logger.info("working on\n%s", rid)

        async def main() -> None:
            a, b = asyncio.Event(), asyncio.Event()
            await asyncio.gather(one("r1", a, b), one("r2", b, a))

        asyncio.run(main())
        logger.warning("no request here")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed", extra={"request_id": "r9"})
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # the newline inside a message stays inside its JSON string
    rows = [json.loads(line) for line in lines]
    by_rid = {r.get("request_id"): r for r in rows}
    assert by_rid["r1"]["trace_id"] == "trace-r1" and by_rid["r1"]["message"] == "working on\nr1"
    assert by_rid["r2"]["trace_id"] == "trace-r2" and by_rid["r2"]["level"] == "INFO"
    plain = by_rid[None]
    assert plain == {"time": plain["time"], "level": "WARNING", "logger": "lockgate.test.json",
                     "message": "no request here"}
    assert plain["time"].endswith("Z") and "T" in plain["time"]
    assert "RuntimeError: boom" in by_rid["r9"]["exc"] and "trace_id" not in by_rid["r9"]
    assert REQUEST_ID.get() is None  # the blocks restored the context


def test_configure_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="text, json.*'yaml'"):
        configure(logging.INFO, "yaml")


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "lockgate.cli", *argv], capture_output=True, text=True,
                          env=full, timeout=60, cwd=ROOT)


def test_cli_json_format_writes_one_object_per_line() -> None:
    # an unreachable broker (port 1): the bus logs its retries at DEBUG, then the command fails
    r = _cli("--log-level", "DEBUG", "topics", "list", "--bus", "kafka://127.0.0.1:1", "--connect-timeout", "1",
             env={"LOCKGATE_LOG_FORMAT": "json"})
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    *logs, last = lines
    assert "unreachable" in last  # the user-facing error stays a plain line
    rows = [json.loads(ln) for ln in logs]
    assert rows and all({"time", "level", "logger", "message"} <= set(r) for r in rows)
    assert any(r["logger"].startswith("bus") and "unreachable" in r["message"] for r in rows)


def test_cli_text_is_the_default_and_a_bad_env_value_is_named() -> None:
    r = _cli("--log-level", "DEBUG", "topics", "list", "--bus", "kafka://127.0.0.1:1", "--connect-timeout", "1")
    assert r.returncode == 1
    assert " DEBUG bus" in r.stderr and not r.stderr.lstrip().startswith("{")
    r = _cli("topics", "list", env={"LOCKGATE_LOG_FORMAT": "yaml"})
    assert r.returncode == 2 and "--log-format must be one of text, json, not 'yaml'" in r.stderr
