"""Wait for a condition, never for a fixed time: the one poll-until-deadline helper of the suite.

A test that sleeps a fixed time and then asserts is either slow (the sleep is long enough for the
slowest CI host) or flaky (it is not). These helpers poll the condition the test is about to
assert on and return as soon as it holds; on a host too slow for ``timeout`` they fail with an
``AssertionError`` naming what was waited for.

* ``await wait_until(predicate, timeout=5.0, interval=0.01, message=None)`` — ``predicate`` is a
  plain callable or one returning an awaitable (an ``async def`` or a lambda calling one); returns
  its first truthy result.
* ``wait_until_sync(...)`` — the same for plain (thread) tests; ``predicate`` must be sync.
* ``suspended(task)`` — a predicate: ``task`` has started and is parked at an ``await`` (e.g. a
  ``getmany`` waiting for records), for tests that must act while a call is waiting.

``message`` (a string, or a callable giving one at the timeout so it can show the state then)
defaults to the predicate's source line.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_S = 0.01

Message = str | Callable[[], str] | None


async def wait_until(predicate: Callable[[], T | Awaitable[T]], *, timeout: float = DEFAULT_TIMEOUT_S,
                     interval: float = DEFAULT_INTERVAL_S, message: Message = None) -> T:
    """Poll ``predicate`` (sync or async) every ``interval`` s until it returns something truthy,
    and return that; raise ``AssertionError`` naming the condition if ``timeout`` s pass first.
    The predicate is always tried at least once, and once more at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if loop.time() >= deadline:
            raise AssertionError(_timed_out(predicate, timeout, message))
        await asyncio.sleep(min(interval, max(0.0, deadline - loop.time())))


def wait_until_sync(predicate: Callable[[], T], *, timeout: float = DEFAULT_TIMEOUT_S,
                    interval: float = DEFAULT_INTERVAL_S, message: Message = None) -> T:
    """:func:`wait_until` for code without an event loop (blocks the calling thread)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            raise TypeError("wait_until_sync needs a sync predicate; use wait_until for an async one")
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(predicate, timeout, message))
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def suspended(task: asyncio.Task[Any]) -> bool:
    """True once ``task`` has started running and is parked at an ``await`` (not before its first
    step, not once done)."""
    return not task.done() and inspect.getcoroutinestate(task.get_coro()) == inspect.CORO_SUSPENDED  # type: ignore[arg-type]


def _timed_out(predicate: Callable[[], object], timeout: float, message: Message) -> str:
    if callable(message):
        what = message()
    elif message is not None:
        what = message
    else:
        what = _describe(predicate)
    return f"waited {timeout:g}s for: {what}"


def _describe(predicate: Callable[[], object]) -> str:
    """The predicate's source line (a lambda's reads as the condition), else its name."""
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return getattr(predicate, "__qualname__", repr(predicate))


__all__ = ["DEFAULT_INTERVAL_S", "DEFAULT_TIMEOUT_S", "suspended", "wait_until", "wait_until_sync"]
