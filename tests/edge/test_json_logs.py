"""The edge's log lines about a request carry its request id in ``--log-format json``."""

from __future__ import annotations

import io
import json
import logging

from lockgate.logformat import JsonFormatter
from tests.edge.conftest import client, recv, running_edge, send, wait_for


async def test_a_failed_publish_logs_the_request_id(encoder):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("edge")
    logger.addHandler(handler)
    try:
        async with running_edge(encoder) as (edge, _fw):
            async with client(edge) as ws:
                await edge.bus.stop()  # the bus refuses every send from here on
                await send(ws, {"type": "generate", "id": "c1", "prompt": "hello", "max_tokens": 2})
                frames = []
                while not frames or frames[-1].get("type") != "error":
                    frames.append(await recv(ws))
                rid = frames[-1]["request_id"]
                assert rid and frames[-1]["code"] == "overloaded"  # the bus down is a 503 (docs/protocol.md)
                await wait_for(lambda: "publishing" in out.getvalue())
    finally:
        logger.removeHandler(handler)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    failed = [r for r in rows if r["message"].startswith("publishing")]
    assert failed and failed[0]["request_id"] == rid and failed[0]["level"] == "WARNING"
    assert failed[0]["logger"] == "edge.admission.gate"
