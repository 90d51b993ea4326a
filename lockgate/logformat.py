"""``--log-format``: the text lines lockgate always printed, or one JSON object per line.

A JSON line has ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``message``,
and, where known, ``request_id`` and ``trace_id`` (from :mod:`bus.logcontext`, or a record's
``extra={"request_id": ...}``), and ``exc`` (the formatted traceback) when one was logged. Log
shippers (Loki, Elasticsearch, CloudWatch) index the fields without a parsing rule.
"""

from __future__ import annotations

import json
import logging
import time

from bus import REQUEST_ID, TRACE_ID

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside the message are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        secs = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, object] = {
            "time": f"{secs}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        tid = getattr(record, "trace_id", None) or TRACE_ID.get()
        if rid is not None:
            out["request_id"] = str(rid)
        if tid is not None:
            out["trace_id"] = str(tid)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: int, fmt: str) -> None:
    """Install the root handler (stderr) with the chosen format; ``fmt`` is one of :data:`FORMATS`."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    # basicConfig's rule: a process that already configured logging (an embedding app, pytest's
    # capture) keeps its handlers
    logging.basicConfig(level=level, handlers=[handler])
