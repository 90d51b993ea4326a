"""Fuzzed client frames: never crash, each bad frame gets an `error`, the connection stays usable.

The edge runs on its own event loop in a thread; hypothesis drives a synchronous client."""

from __future__ import annotations

import asyncio
import threading

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from tests.edge.conftest import KEY, running_edge

FIELDS = ["type", "id", "model", "messages", "prompt", "token_ids", "max_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "request_id", "role", "content"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
    st.sampled_from(["generate", "cancel", "user", "", "\x00", "\ud7ff", "🙂" * 10, "1e309"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8),
                                                                      inner, max_size=4)), max_leaves=12)
objects = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), values, max_size=7)
mutated = st.builds(
    lambda k, v: {"type": "generate", "id": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                  **{k: v}},
    st.sampled_from(FIELDS), values)
raw_frames = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200),
    objects.map(lambda o: orjson.dumps(o).decode()),
    mutated.map(lambda o: orjson.dumps(o).decode()),
    st.just('{"type":"generate","id":"x","prompt":"hi","max_tokens":1e400}'),
    st.just('{"type":"generate","id":"x","prompt":"hi","max_tokens":123456789012345678901234567890}'),
    st.just('{"type":"generate","id":"x","prompt":"\\ud800"}'),
)
PROBE = orjson.dumps({"type": "cancel", "id": "__probe__"}).decode()


@pytest.fixture(scope="module")
def edge_port(encoder):
    ready = threading.Event()
    box: dict = {}

    async def main() -> None:
        box["loop"] = asyncio.get_running_loop()
        box["stop"] = asyncio.Event()
        # every accepted request fails at the (fake) worker at once: the fuzz sees no long streams
        async with running_edge(encoder, worker_kw={"error": "invalid_request"}, max_frame_bytes=64 * 1024,
                                keys=None) as (edge, _):
            box["port"] = edge.port
            box["edge"] = edge
            ready.set()
            await box["stop"].wait()

    t = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    t.start()
    assert ready.wait(60), "edge did not start"
    yield box["port"]
    box["loop"].call_soon_threadsafe(box["stop"].set)
    t.join(30)


@pytest.fixture(scope="module")
def ws(edge_port):
    with connect(f"ws://127.0.0.1:{edge_port}/ws", additional_headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(frame=raw_frames)
def test_fuzzed_frames(ws, frame):
    ws.send(frame)
    ws.send(PROBE)
    seen = []
    while True:
        f = orjson.loads(ws.recv(timeout=10))
        if f.get("id") == "__probe__":
            assert f["type"] == "error" and f["field"] == "id"
            break
        seen.append(f)
    assert seen, "every frame gets an answer"
    assert seen[0]["type"] in ("error", "accepted"), seen
    if seen[0]["type"] == "error":
        assert seen[0]["code"] in ("invalid_request", "rate_limited", "overloaded") and seen[0]["message"]
    assert all(f["type"] in ("error", "accepted", "delta", "done") for f in seen)


def test_connection_still_usable_after_fuzz(ws):
    ws.send('{"type":"generate","id":"after","prompt":"hello","max_tokens":2}')
    assert orjson.loads(ws.recv(timeout=10))["type"] == "accepted"
    assert orjson.loads(ws.recv(timeout=10))["code"] == "invalid_request"  # from the erroring fake worker
