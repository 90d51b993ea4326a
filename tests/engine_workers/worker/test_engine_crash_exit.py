"""A crash of the engine's step loop (a tensor-parallel rank that died, a failing kernel) ends
``Worker.run`` with 1 at once: the worker stops without committing the crashed work, so the
process exits non-zero and its partitions' requests resume on another worker, as after kill -9."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from bus import MemoryBus, TopicLayout, WorkerStatus, decode
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.worker.actor import Worker, WorkerConfig
from lockgate_types import SamplingParams
from tests.engine_workers.worker.test_worker_memory import MODEL, make_engine


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from devtools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


async def test_worker_run_returns_1_when_the_step_loop_crashes(tiny_dir: Path) -> None:
    layout = TopicLayout(namespace=f"t{uuid.uuid4().hex[:8]}", partitions=1)

    def crash() -> None:
        raise RuntimeError("injected step crash")

    aengine = AsyncEngine(make_engine(tiny_dir), before_step=crash)
    async with MemoryBus() as bus:
        w = Worker(WorkerConfig(MODEL, layout=layout, commit_interval_s=0), bus, aengine)
        try:
            await w.start()
            run = asyncio.ensure_future(w.run())
            # straight into the engine: the point is the worker's reaction to its engine's crash
            aengine.submit("r0", [5, 6, 7], SamplingParams(max_tokens=4))
            assert await asyncio.wait_for(run, 30) == 1
            assert not w.live() and isinstance(aengine.error, RuntimeError)
        finally:
            await w.stop()
            await aengine.stop()


async def test_a_crashed_worker_leaves_no_leaving_heartbeat_so_peers_take_over(tiny_dir: Path) -> None:
    """A clean stop ends with a ``draining`` heartbeat (peers forget the worker); a crash of the
    engine (a tensor-parallel rank died) must not: peers then presume it dead from its silence and
    take its requests over within the detection time (worker/failover), as after kill -9."""
    layout = TopicLayout(namespace=f"t{uuid.uuid4().hex[:8]}", partitions=1)

    def crash() -> None:
        raise RuntimeError("injected rank death")

    async with MemoryBus() as bus:
        await bus.ensure_topics(layout.model_specs(MODEL))
        status = bus.consumer([layout.status_topic], start_from="earliest")
        await status.start()
        for before_step, leaves in ((None, True), (crash, False)):
            aengine = AsyncEngine(make_engine(tiny_dir), before_step=before_step)
            w = Worker(WorkerConfig(MODEL, layout=layout, commit_interval_s=0, heartbeat_s=0.05,
                                    worker_id=f"w-{leaves}"), bus, aengine)
            try:
                await w.start()
                if before_step is not None:
                    run = asyncio.ensure_future(w.run())
                    aengine.submit("r0", [5, 6, 7], SamplingParams(max_tokens=4))
                    assert await asyncio.wait_for(run, 30) == 1
            finally:
                await w.stop()
                await aengine.stop()
            beats = [decode(r.value) for r in await status.getmany(timeout_ms=200)]
            mine = [b for b in beats if isinstance(b, WorkerStatus) and b.worker_id == w.config.worker_id]
            assert mine and mine[-1].draining is leaves, (leaves, mine[-1:])
        await status.stop()
