"""Process set-up shared by every long-running command (edge, worker, serve) and the benchmarks:
the event loop, the garbage collector's treatment of start-up state, the open-file limit."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on uvloop when installed, else the default asyncio loop; returns
    its result. Every long-running command (edge, worker, serve) and the benchmarks use it."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


GC_GEN0_THRESHOLD = 50_000  # allocations minus frees between young collections (CPython: 700)


def freeze_heap() -> None:
    """Move every object alive now into the garbage collector's permanent generation.

    Called once a server has started (modules imported, tokenizer/model loaded) and before it
    takes traffic. Those millions of long-lived objects are otherwise re-traversed by every full
    (gen-2) collection, a stop-the-world pause. Frozen objects are still freed by reference counting; only cycles among them are
    never collected, which is fine for start-up state that lives as long as the process."""
    import atexit
    import gc

    gc.collect()
    gc.freeze()
    # At exit, hand them back before the interpreter finalizes: frozen cycles are never freed,
    # and torch's triton bindings (nanobind) then print lines of "leaked instances/types"
    # after every clean shutdown of a server. Registered once however often this is called.
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    # Objects created after start-up (10,000 connections' state) are long-lived too; with the
    # default thresholds (700, 10, 10) the young generations are collected every few hundred
    # allocations and a full collection traverses every connection, a stop-the-world pause that
    # grows with the connection count and made up the edge's whole p99 tail (docs/design-history.md,
    # "Garbage collector policy of the servers"). Reference counting frees nearly everything a server allocates
    # per frame, so collecting far less often costs little memory and takes the pauses away.
    gc.set_threshold(GC_GEN0_THRESHOLD, 50, 1000)


def raise_nofile(want: int = 1 << 20) -> int:
    """Raise the open-file limit toward ``want`` (up to the hard limit); returns the new soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(want, hard) if hard != resource.RLIM_INFINITY else want
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft
