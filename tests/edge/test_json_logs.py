"""The edge's log lines about a request carry its request id in ``--log-format json`` (and, with
tracing on, its trace id)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from websockets.asyncio.client import connect

from lockgate.logformat import JsonFormatter
from tests.edge.conftest import KEY, client, recv, running_edge, send, url, wait_for
from tracing import SpanKind, SpanRecord, Tracer


@contextmanager
def json_log(name: str = "edge") -> Iterator[io.StringIO]:
    """Capture logger ``name``'s lines, formatted as ``--log-format json`` writes them."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield out
    finally:
        logger.removeHandler(handler)


async def test_a_failed_publish_logs_the_request_id(encoder):
    with json_log() as out:
        async with running_edge(encoder) as (edge, _fw):
            async with client(edge) as ws:
                await edge.bus.stop()  # the bus refuses every send from here on
                await send(ws, {"type": "generate", "id": "c1", "prompt": "hello", "max_tokens": 2})
                frames = []
                while not frames or frames[-1].get("type") != "error":
                    frames.append(await recv(ws))
                rid = frames[-1]["request_id"]
                assert rid and frames[-1]["code"] == "overloaded"
                await wait_for(lambda: "publishing" in out.getvalue())
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    failed = [r for r in rows if r["message"].startswith("publishing")]
    assert failed and failed[0]["request_id"] == rid and failed[0]["level"] == "WARNING"
    assert failed[0]["logger"] == "edge.admission.gate"


async def test_with_tracing_on_the_line_carries_the_trace_id_and_the_spans_say_why(encoder):
    spans: list[SpanRecord] = []
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with json_log() as out:
        async with running_edge(encoder, tracer=Tracer(spans.append)) as (edge, _fw):
            headers = {"Authorization": f"Bearer {KEY}", "traceparent": f"00-{trace}-00f067aa0ba902b7-01"}
            async with connect(url(edge), additional_headers=headers) as ws:
                await edge.bus.stop()
                await send(ws, {"type": "generate", "id": "c1", "prompt": "hello", "max_tokens": 2})
                frames = []
                while not frames or frames[-1].get("type") != "error":
                    frames.append(await recv(ws))
                assert frames[-1]["code"] == "overloaded"
                await wait_for(lambda: "publishing" in out.getvalue() and len(spans) == 2)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    failed = [r for r in rows if r["message"].startswith("publishing")]
    assert failed and failed[0]["trace_id"] == trace and failed[0]["request_id"] == frames[-1]["request_id"]
    by = {s.name: s for s in spans}
    req, pub = by["lockgate.request"], by["lockgate.publish"]
    assert req.trace_id == pub.trace_id == trace and pub.parent_id == req.span_id and req.parent_id == "00f067aa0ba902b7"
    assert (req.kind, pub.kind) == (SpanKind.SERVER, SpanKind.PRODUCER)
    assert pub.error is not None and pub.error.startswith("publish failed:")
    assert req.error is not None and req.error.startswith("overloaded: the request was not queued")


class _BrokenPlacement:
    """A placement with a bug in it: a programming error, not a bus outage."""

    async def place(self, topic, req):
        raise TypeError("placement bug")


async def test_a_bug_while_publishing_is_internal_not_a_retryable_outage(encoder):
    with json_log() as out:
        async with running_edge(encoder) as (edge, _fw):
            edge.admission.placement = _BrokenPlacement()
            async with client(edge) as ws:
                await send(ws, {"type": "generate", "id": "c1", "prompt": "hello", "max_tokens": 2})
                frames = []
                while not frames or frames[-1].get("type") != "error":
                    frames.append(await recv(ws))
                assert frames[-1]["code"] == "internal" and "placement bug" in frames[-1]["message"]
                assert "retry_after" not in frames[-1] or frames[-1]["retry_after"] is None
                # the connection stays usable and the traceback is logged for the operator
                await wait_for(lambda: "placement bug" in out.getvalue())
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    failed = [r for r in rows if r["message"].startswith("publishing")]
    assert failed and failed[0]["level"] == "ERROR"
