"""The process's one torch thread (engine_workers/torch_thread.py)."""

from __future__ import annotations

import threading

import pytest

from engine_workers import torch_thread


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
    from bus.messages import SamplingParams
    from engine_workers.config import EngineConfig
    from engine_workers.engine import Engine

    engine = Engine(EngineConfig(model=tiny_model_dir, kv_cache_bytes=4 << 20))
    where: list[bool] = []
    execute = engine.runner.execute

    def spy(chunks):
        where.append(torch_thread.on_torch_thread())
        return execute(chunks)

    engine.runner.execute = spy
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert where and all(where)
