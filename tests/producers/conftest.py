"""Fixtures for the producer tests: a tiny model, unique topic namespaces, an in-process worker.

``serving(bus, model_dir, layout)`` runs the real engine worker (``engine_workers.worker.actor.Worker``
over a CPU engine of the tiny model, one torch thread, 8 MiB of KV). Set
``LOCKGATE_PRODUCERS_FAKE_WORKER=1`` to use the edge's model-less FakeWorker instead (a harness
check only: it speaks the same bus contract, with deterministic text).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bus import TopicLayout


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from devtools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("producers") / "tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from producers.prompting import Tokenizer

    return Tokenizer.for_model(str(tiny_model))


@pytest.fixture
def layout() -> TopicLayout:
    return TopicLayout(namespace=f"t-prod-{uuid.uuid4().hex[:10]}", partitions=2)


def fake_worker_mode() -> bool:
    return os.environ.get("LOCKGATE_PRODUCERS_FAKE_WORKER", "") not in ("", "0")


@contextlib.asynccontextmanager
async def serving(bus, model_dir: Path, layout: TopicLayout, **worker_kw) -> AsyncIterator[object]:
    """One worker for ``model_dir`` on ``bus`` under ``layout``; stopped on exit."""
    name = model_dir.name
    if fake_worker_mode():
        from devtools.fake_worker import FakeWorker

        w = FakeWorker(bus, name, layout, step_s=worker_kw.get("step_s", 0.0))
    else:
        import asyncio

        from engine_workers.engine.config import EngineConfig
        from engine_workers.engine.core import Engine
        from engine_workers.worker.actor import Worker, WorkerConfig

        engine = await asyncio.to_thread(Engine, EngineConfig(model=str(model_dir), device="cpu", num_threads=1,
                                                              kv_cache_bytes=8 << 20, max_num_seqs=16))
        w = Worker(WorkerConfig(model=name, layout=layout, heartbeat_s=0.2,
                                metrics_port=worker_kw.get("metrics_port")), bus, engine)
    await w.start()
    try:
        yield w
    finally:
        await w.stop()
