"""The real OpenTelemetry Collector as the tests' OTLP receiver (``make otel-check``): the binary
scripts/otelcol.sh builds (OTLP receiver + debug exporter), started on 127.0.0.1 with a config of
the test's own, and a reader of what its debug exporter (``verbosity: detailed``) prints, turned
into the same :class:`~tests.tracing.receiver.GotSpan` rows as the stdlib receiver gives.

``LOCKGATE_OTELCOL``: the binary's path (the make target sets it from scripts/otelcol.sh's output);
without it the tests that need the collector are skipped (tests/conftest.py): they are opt-in,
because a cold build takes minutes and needs the Go module proxy.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.tracing.receiver import GotSpan, dead_endpoint

ENV = "LOCKGATE_OTELCOL"
_KINDS = {"Unspecified": 0, "Internal": 1, "Server": 2, "Client": 3, "Producer": 4, "Consumer": 5}
_STATUS = {"Unset": 0, "Ok": 1, "Error": 2}
_ATTR = re.compile(r"^\s+-> ([^:]+): (\w+)\((.*)\)$")
_FIELD = re.compile(r"^    ([A-Za-z ]+?)\s*: ?(.*)$")

CONFIG = """receivers:
  otlp:
    protocols:
      http:
        endpoint: {endpoint}
exporters:
  debug:
    verbosity: detailed
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [debug]
"""


def _value(kind: str, text: str) -> Any:
    if kind == "Int":
        return int(text)
    if kind == "Double":
        return float(text)
    if kind == "Bool":
        return text == "true"
    return text


def _ns(text: str) -> int:
    """``2026-12-07 09:23:23.170570846 +0000 UTC`` as UNIX nanoseconds (Go prints 9 digits or fewer)."""
    day, clock = text.split()[:2]
    whole, _, frac = clock.partition(".")
    secs = int(datetime.strptime(f"{day} {whole}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp())
    return secs * 1_000_000_000 + int((frac or "0").ljust(9, "0")[:9])


def parse_debug_output(text: str) -> list[GotSpan]:
    """Every span the debug exporter printed, with its resource's attributes."""
    out: list[GotSpan] = []
    resource: dict[str, Any] = {}
    span: dict[str, Any] | None = None
    where = ""  # which attribute list the "->" lines belong to: "resource" or "span"

    def flush() -> None:
        nonlocal span
        if span is not None:
            out.append(GotSpan(str(resource.get("service.name", "")), span["Trace ID"], span["ID"],
                               span.get("Parent ID", ""), span["Name"], _KINDS[span["Kind"]], _ns(span["Start time"]),
                               _ns(span["End time"]), span["attrs"], _STATUS[span["Status code"]],
                               span.get("Status message", ""), dict(resource)))
            span = None

    for line in text.splitlines():
        if "ResourceSpans #" in line:
            flush()
            resource, where = {}, ""
        elif line.startswith("Resource attributes:"):
            where = "resource"
        elif line.startswith("Span #"):
            flush()
            span, where = {"attrs": {}}, ""
        elif line.startswith("Attributes:") and span is not None:
            where = "span"
        elif line.startswith("ScopeSpans #") or line.startswith("\t{"):
            flush()
            where = ""
        elif (m := _ATTR.match(line)) and where:
            into = resource if where == "resource" or span is None else span["attrs"]
            into[m.group(1)] = _value(m.group(2), m.group(3))
        elif span is not None and (f := _FIELD.match(line)):
            span[f.group(1)] = f.group(2).strip()
    flush()
    return out


@contextlib.contextmanager
def collector(binary: str, workdir: Path) -> Iterator[tuple[str, Path]]:
    """The collector listening for OTLP/HTTP on a free 127.0.0.1 port: yields its base endpoint
    and the file its debug output goes to. Stopped (SIGTERM, then SIGKILL) on exit."""
    from tests.waiting import wait_until_sync

    endpoint = dead_endpoint().removeprefix("http://")  # a free port
    cfg = workdir / "otelcol.yaml"
    cfg.write_text(CONFIG.format(endpoint=endpoint))
    log = workdir / "otelcol.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([binary, "--config", f"file:{cfg}"], stdout=f, stderr=subprocess.STDOUT)
    try:
        host, port = endpoint.rsplit(":", 1)

        def listening() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the collector exited {proc.returncode}: {log.read_text()[-2000:]}")
            with socket.socket() as s:
                s.settimeout(0.5)
                return s.connect_ex((host, int(port))) == 0

        wait_until_sync(listening, timeout=30, interval=0.05)
        yield f"http://{endpoint}", log
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def binary() -> str | None:
    path = os.environ.get(ENV, "").strip()
    return path or None
