"""An OTLP/HTTP receiver for the tracing tests: a stdlib HTTP server on 127.0.0.1 that records
every body POSTed to ``/v1/traces`` and checks it against the official OTLP protobuf definitions
(``opentelemetry-proto``, a dev dependency) with ``json_format.Parse``, which is strict: an
unknown field, a wrong type or a bad enum fails the parse.

One deviation from the plain protobuf JSON mapping is OTLP's own: trace and span ids are hex
strings, not base64 (the OTLP/HTTP spec, "JSON Protobuf Encoding"). The receiver checks they are
lowercase hex of the right length and turns them into base64 before parsing, as a collector does.
"""

from __future__ import annotations

import base64
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_ID_LEN = {"traceId": 32, "spanId": 16, "parentSpanId": 16}


def _ids_to_base64(span: dict[str, Any]) -> None:
    for key, n in _ID_LEN.items():
        if key in span:
            v = span[key]
            assert isinstance(v, str) and len(v) == n and v == v.lower(), f"{key} {v!r} is not {n} lowercase hex"
            span[key] = base64.b64encode(bytes.fromhex(v)).decode()


def parse_otlp_json(body: bytes) -> ExportTraceServiceRequest:
    """``body`` as an ``ExportTraceServiceRequest``; raises if it is not one."""
    doc = orjson.loads(body)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                _ids_to_base64(sp)
    msg = ExportTraceServiceRequest()
    json_format.Parse(orjson.dumps(doc), msg)  # ignore_unknown_fields=False: strict
    return msg


def _any(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


@dataclass(frozen=True, slots=True)
class GotSpan:
    """One received span, flattened: ids as hex, attributes as a dict."""

    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    resource: dict[str, Any] = field(default_factory=dict)
    trace_state: str = ""


def flatten(msg: ExportTraceServiceRequest) -> list[GotSpan]:
    out = []
    for rs in msg.resource_spans:
        resource = {a.key: _any(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(GotSpan(str(resource.get("service.name", "")), s.trace_id.hex(), s.span_id.hex(),
                                   s.parent_span_id.hex(), s.name, s.kind, s.start_time_unix_nano,
                                   s.end_time_unix_nano, {a.key: _any(a.value) for a in s.attributes},
                                   s.status.code, s.status.message, resource, s.trace_state))
    return out


class Receiver:
    """``url``: the OTLP base endpoint to give an exporter. ``status``: what POSTs are answered
    with (200; set 500 to play a failing collector). ``hold``: while cleared, POSTs wait on it
    (a stuck collector); set by default. ``bodies``/``errors``: every POST's body and, for one that
    did not parse, why; ``spans()``: every span that parsed so far."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.content_types: list[str] = []
        self.errors: list[str] = []
        self.requests: list[ExportTraceServiceRequest] = []
        self.status = 200
        self.hold = threading.Event()
        self.hold.set()
        self.in_flight = 0
        self._lock = threading.Lock()
        rcv = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with rcv._lock:
                    rcv.in_flight += 1
                rcv.hold.wait(30)
                with rcv._lock:
                    rcv.in_flight -= 1
                    rcv.bodies.append(body)
                    rcv.content_types.append(self.headers.get("Content-Type", ""))
                    if self.path != "/v1/traces":
                        rcv.errors.append(f"POST to {self.path}")
                    else:
                        try:
                            rcv.requests.append(parse_otlp_json(body))
                        except Exception as exc:
                            rcv.errors.append(f"{type(exc).__name__}: {exc}")
                self.send_response(rcv.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="otlp-receiver", daemon=True)

    def spans(self) -> list[GotSpan]:
        with self._lock:
            reqs = list(self.requests)
        return [s for r in reqs for s in flatten(r)]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)


@contextlib.contextmanager
def receiving() -> Iterator[Receiver]:
    r = Receiver()
    r.start()
    try:
        yield r
    finally:
        r.stop()


def dead_endpoint() -> str:
    """An OTLP endpoint on 127.0.0.1 where nothing listens (a port bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
