"""The suite's waiting helpers (``tests.waiting``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.waiting import suspended, wait_until, wait_until_sync


async def test_wait_until_returns_the_first_truthy_result() -> None:
    calls: list[int] = []

    def third_time() -> list[int] | None:
        calls.append(1)
        return calls if len(calls) >= 3 else None

    assert await wait_until(third_time, interval=0) == [1, 1, 1]


async def test_wait_until_takes_an_async_predicate() -> None:
    event = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, event.set)

    async def is_set() -> bool:
        return event.is_set()

    assert await wait_until(is_set) is True


async def test_wait_until_names_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"waited 0.05s for: .*never"):
        await wait_until(lambda: "never" == "ever", timeout=0.05)
    state = {"n": 7}
    with pytest.raises(AssertionError, match="n is 7"):
        await wait_until(lambda: False, timeout=0.01, message=lambda: f"n is {state['n']}")


def test_wait_until_sync() -> None:
    flag = threading.Event()
    threading.Timer(0.02, flag.set).start()
    assert wait_until_sync(flag.is_set) is True
    with pytest.raises(AssertionError, match="the flag"):
        wait_until_sync(lambda: False, timeout=0.01, message="the flag")


async def test_suspended_is_true_while_a_task_waits() -> None:
    release = asyncio.Event()
    task = asyncio.create_task(release.wait())
    assert not suspended(task)  # not started yet
    await wait_until(lambda: suspended(task))
    release.set()
    await task
    assert not suspended(task)
