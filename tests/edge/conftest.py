"""Fixtures for the edge tests: a tiny tokenizer, a memory bus, an edge + fake worker on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import orjson
import pytest
import websockets
from websockets.asyncio.client import connect

from bus import MemoryBus
from devtools.fake_worker import FakeWorker
from edge.config import EdgeConfig, KeyEntry, hash_key
from edge.request import PromptEncoder
from edge.server import Edge
from tests.waiting import wait_until

MODEL = "tiny"
KEY = "lg-test-key-p1"
KEY_P0 = "lg-test-key-p0"


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> str:
    from devtools.tiny_model import build_tokenizer

    # Only the tokenizer and config are needed at the edge: skip the (slower) model weights.
    out = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer()
    tok.save_pretrained(out)
    (out / "config.json").write_text('{"max_position_embeddings": 1024}')
    return str(out)


@pytest.fixture(scope="session")
def encoder(tiny_path) -> PromptEncoder:
    return PromptEncoder.from_path(tiny_path)


def keys(**limits) -> dict[str, KeyEntry]:
    e1 = KeyEntry(hash_key(KEY), "acme", 1, **limits)
    e0 = KeyEntry(hash_key(KEY_P0), "vip", 0)
    return {e1.key_hash: e1, e0.key_hash: e0}


@contextlib.asynccontextmanager
async def running_edge(encoder, *, worker: bool = True, worker_kw: dict | None = None, tracer=None,
                       **cfg) -> AsyncIterator[tuple[Edge, FakeWorker | None]]:
    bus = MemoryBus()
    await bus.start()
    cfg.setdefault("keys", keys())
    cfg.setdefault("ping_interval_s", None)
    config = EdgeConfig(model=MODEL, port=0, **cfg)
    fw = FakeWorker(bus, MODEL, **(worker_kw or {})) if worker else None
    try:
        if fw is not None:
            await fw.start()
        async with Edge(config, bus, encoder, tracer=tracer) as edge:
            if fw is not None:
                await wait_for(lambda: edge.readiness()[0])
            yield edge, fw
    finally:
        if fw is not None:
            await fw.stop()
        await bus.stop()


async def wait_for(pred: Callable[[], object], timeout: float = 5.0, interval: float = 0.01) -> None:
    """The suite's :func:`tests.waiting.wait_until`, under the name the edge tests know."""
    await wait_until(pred, timeout=timeout, interval=interval)


def url(edge: Edge, path: str = "/ws") -> str:
    return f"ws://127.0.0.1:{edge.port}{path}"


def client(edge: Edge, key: str | None = KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return connect(url(edge), additional_headers=headers, **kw)


async def send(ws, obj) -> None:
    await ws.send(orjson.dumps(obj).decode())


async def recv(ws, timeout: float = 5.0) -> dict:
    import asyncio

    return orjson.loads(await asyncio.wait_for(ws.recv(), timeout))


async def collect(ws, cid: str, timeout: float = 10.0) -> tuple[str, list[dict], dict]:
    """Read frames for request ``cid`` until its done/error; returns (text, deltas, final frame)."""
    text, deltas = [], []
    while True:
        f = await recv(ws, timeout)
        if f.get("id") != cid:
            continue
        if f["type"] == "delta":
            deltas.append(f)
            text.append(f["text"])
        elif f["type"] in ("done", "error"):
            return "".join(text), deltas, f


__all__ = ["KEY", "KEY_P0", "MODEL", "client", "collect", "keys", "recv", "running_edge", "send", "url",
           "wait_for", "websockets"]
