"""The process's one torch thread (engine_workers/engine/torch_thread.py)."""

from __future__ import annotations

import threading
import time

import pytest

from engine_workers.engine import torch_thread
from tests.waiting import wait_until_sync


def test_calls_from_any_thread_run_on_one_thread() -> None:
    seen: list[threading.Thread] = []
    torch_thread.call(lambda: seen.append(threading.current_thread()))
    t = threading.Thread(target=lambda: torch_thread.call(lambda: seen.append(threading.current_thread())))
    t.start()
    t.join()
    assert len(seen) == 2 and seen[0] is seen[1]
    assert seen[0] is not threading.main_thread() and seen[0] is not t
    assert not torch_thread.on_torch_thread()


def test_reentrant_and_returns_result() -> None:
    def outer() -> tuple[bool, int]:
        return torch_thread.on_torch_thread(), torch_thread.call(lambda x, y=0: x + y, 2, y=3)

    assert torch_thread.call(outer) == (True, 5)


def test_exception_reaches_caller_and_thread_survives() -> None:
    def boom() -> None:
        raise ValueError("bad field")

    with pytest.raises(ValueError, match="bad field"):
        torch_thread.call(boom)
    assert torch_thread.call(lambda: 7) == 7


def test_engine_step_runs_on_torch_thread(tiny_model_dir) -> None:
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from lockgate_types import SamplingParams

    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20))
    where: list[bool] = []
    execute = engine.runner.execute

    def spy(chunks, **kwargs):
        where.append(torch_thread.on_torch_thread())
        return execute(chunks, **kwargs)

    engine.runner.execute = spy
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert where and all(where)


def test_others_waiting_sees_a_queued_call() -> None:
    started, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def hold() -> None:  # occupies the torch thread until released
        started.set()
        release.wait(10)
        seen.append(torch_thread.others_waiting())

    holder = threading.Thread(target=lambda: torch_thread.call(hold))
    holder.start()
    assert started.wait(10)
    assert not torch_thread.others_waiting()
    queued = threading.Thread(target=lambda: torch_thread.call(lambda: None))
    queued.start()
    wait_until_sync(torch_thread.others_waiting, timeout=5.0, interval=0.005)  # the second call is queued
    release.set()
    holder.join(10)
    queued.join(10)
    assert seen == [True]
    assert not torch_thread.others_waiting()


async def test_two_async_engines_take_turns_on_the_torch_thread(tiny_model_dir) -> None:
    """Each AsyncEngine runs its steps back to back on the torch thread, but returns it whenever
    another call waits: two busy engines of one process both stream, interleaved, to the end."""
    import asyncio

    from engine_workers.engine.async_engine import AsyncEngine
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from lockgate_types import SamplingParams

    engines = [AsyncEngine(Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20))) for _ in range(2)]
    times: dict[int, list[float]] = {0: [], 1: []}

    async def stream(i: int) -> int:
        n = 0
        async for out in engines[i].generate(f"e{i}", [5, 6, 7, 8], SamplingParams(max_tokens=60, temperature=0.0,
                                                                                      ignore_eos=True)):
            n += len(out.token_ids)
            times[i].append(time.monotonic())
        return n

    for e in engines:
        await e.start()
    try:
        counts = await asyncio.wait_for(asyncio.gather(stream(0), stream(1)), 60)
    finally:
        for e in engines:
            await e.stop()
    assert counts == [60, 60]
    # interleaved: each engine produced output before the other one finished
    assert times[0][0] < times[1][-1] and times[1][0] < times[0][-1]


def test_post_queues_behind_the_waiting_jobs_even_from_the_torch_thread() -> None:
    order: list[str] = []

    def first() -> None:
        torch_thread.post(order.append, "posted")  # from the torch thread: queued, not run inline
        order.append("first")

    torch_thread.call(first)
    assert torch_thread.post(order.append, "last").result(10) is None
    assert order == ["first", "posted", "last"]
    with pytest.raises(ZeroDivisionError):
        torch_thread.post(lambda: 1 / 0).result(10)


async def test_async_engine_steps_on_the_torch_thread_and_holds_no_thread_of_its_own(tiny_model_dir) -> None:
    """No engine thread sits between the event loop and the torch thread: the step loop runs as
    turns posted there. An idle engine holds no turn; the next command posts one."""
    from engine_workers.engine.async_engine import AsyncEngine
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from lockgate_types import SamplingParams
    from tests.waiting import wait_until

    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20))
    stepped_on: set[str] = set()
    ae = AsyncEngine(engine, before_step=lambda: stepped_on.add(threading.current_thread().name))
    before = {t.ident for t in threading.enumerate()}
    await ae.start()
    try:
        for rid in ("a", "b"):  # "b" after the engine went idle: its submit posts a new turn
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            got = [len(o.token_ids) async for o in ae.generate(rid, [5, 6, 7], params)]
            assert sum(got) == 3
            await wait_until(ae._idle.is_set, message="the turn ends with the work")
            assert not ae._scheduled
        started = [t.name for t in threading.enumerate() if t.ident not in before]
        assert stepped_on == {"lockgate-torch"}
        assert all(name == "lockgate-torch" or name.startswith("asyncio_") for name in started), started
    finally:
        await ae.stop()
    await ae.stop()  # idempotent
