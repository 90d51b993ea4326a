"""One thread per process runs every heavy torch computation: model loading, engine steps, baselines.

Why: torch's CPU kernels parallelise with OpenMP (libgomp), which keeps one thread team per
*calling* thread. Once two threads of a process have run parallel torch ops (say, the main thread
loaded the model and ``AsyncEngine``'s thread runs the steps), libgomp counts more managed threads
than cores and switches every team to a very short spin before sleeping, so each of the thousands of
parallel regions in a forward pass pays a futex wake-up: a single matmul on a second thread is
enough to slow every later step noticeably (figures in ``docs/design.md``, "One torch thread").

So :func:`call` runs ``fn`` on the process's torch thread and waits for its result, whichever thread
asks; on the torch thread itself it simply calls ``fn`` (re-entrant). :func:`post` queues ``fn``
there without waiting: ``AsyncEngine``'s step loop runs as such posted turns, so no thread of its own
sits between the event loop and torch. A hand-off costs a thread wake-up: tens of microseconds on
idle cores, but it waits for a core when the cores are busy, so a turn runs its steps back to back
and returns the thread only when the engine is idle or :func:`others_waiting` says another job is
queued.

Contracts:
* Exceptions raised by ``fn`` re-raise in the caller, with their traceback.
* Calls and posts run one at a time in submission order; a long call delays the others (they would share the
  same cores anyway).
* Thread-local torch state (grad mode, ``inference_mode``) of the caller does *not* carry over:
  ``fn`` must set what it needs itself (the runner's ``execute`` is ``inference_mode``).
* The thread is a daemon started on first use and lives as long as the process. If the caller is
  interrupted while waiting (``KeyboardInterrupt``), the call still completes on the torch thread.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_thread: threading.Thread | None = None
_jobs: queue.SimpleQueue = queue.SimpleQueue()


def _serve() -> None:
    while True:
        fut, fn, args, kwargs = _jobs.get()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller, never kills the thread
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        del fut, fn, args, kwargs  # drop references before blocking on the next job


def on_torch_thread() -> bool:
    return _thread is not None and threading.current_thread() is _thread


def others_waiting() -> bool:
    """True when a call is queued for the torch thread: a long job running there (an engine's step
    loop) should return so that it gets its turn."""
    return not _jobs.empty()


def _ensure_started() -> None:
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="lockgate-torch", daemon=True)
            _thread.start()


def post(fn: Callable[..., T], *args, **kwargs) -> concurrent.futures.Future:
    """Queue ``fn(*args, **kwargs)`` on the torch thread and return at once; the future holds its
    result or exception. From the torch thread itself it is queued too (behind the jobs waiting),
    never run inline: a job that posts its own continuation gives the others their turn."""
    _ensure_started()
    fut: concurrent.futures.Future = concurrent.futures.Future()
    _jobs.put((fut, fn, args, kwargs))
    return fut


def call(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run ``fn(*args, **kwargs)`` on the torch thread and return its result (see module doc)."""
    if on_torch_thread():
        return fn(*args, **kwargs)
    _ensure_started()
    fut: concurrent.futures.Future = concurrent.futures.Future()
    _jobs.put((fut, fn, args, kwargs))
    try:
        return fut.result()
    finally:
        del fut  # the exception's traceback references this frame; break the cycle
