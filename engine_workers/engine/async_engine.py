"""Run an :class:`Engine` off the event loop and talk to it from asyncio.

The step loop runs on the process's torch thread (:mod:`engine_workers.engine.torch_thread`; torch
releases the GIL inside kernels), so the event loop — Kafka I/O, heartbeats, cancels, WebSockets —
never waits on a forward pass. The flow is vLLM v1's engine core: a bounded input queue of commands
(adds; aborts beside it, unbounded so that nothing can block one), the step loop, and each step's
outputs handed back to the event loop. No thread waits between the event loop and the torch thread:
a command that finds the loop idle posts a *turn* of it to the torch thread; a turn applies the
commands, steps back to back while the engine has work, and ends when it is idle (the next command
posts a new turn) or when another job waits for the torch thread (it posts its own continuation
behind that job, so another engine of the process gets its turn between two steps).

Contracts:
* ``submit``/``abort`` may be called from the event loop (or any thread) at any time; they are
  queued and applied between two steps (so an abort frees its blocks within one step).
* Each step's outputs are handed to the event loop in one ``call_soon_threadsafe`` call, in step
  order; per request, outputs arrive in token order.
* At most one turn of an engine is queued or running at a time (``_scheduled``, under ``_sched``).
* ``stop()`` returns once the turn in progress has ended, after its current step; requests still
  inside are dropped (callers that need them finished drain first). ``stop`` is idempotent.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine_workers.engine import torch_thread
from engine_workers.engine.core import Engine, RequestOutput
from engine_workers.model.execution.runner import gpu_memory_utilization
from lockgate_types import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine state as of the last step; read from any thread."""

    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    last_batch_tokens: int = 0
    last_batch_seqs: int = 0
    tokens_per_s: float = 0.0  # generated tokens per second over the last few seconds
    max_num_seqs: int = 0
    gpu_memory_utilization: float | None = None  # CUDA: device memory in use (0..1), refreshed <= 1/s; None on CPU
    spec_num_drafts: int = 0  # speculative decoding counters (EngineStats.spec_*)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # LoRA (engine enable_lora): the adapters of the running and the waiting requests, and the
    # adapters one batch may mix (0: LoRA off); vLLM's lora_requests_info gauge reads them
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0
    # Admission accounting (the worker's): blocks the engine's sequences still take before their
    # prefill completes (Scheduler.blocks_to_prefill), and how many add commands the engine had
    # applied when this snapshot was taken (a submit's future resolves to its own number, so the
    # worker knows which of its admissions this snapshot already counts)
    kv_blocks_to_prefill: int = 0
    adds_applied: int = 0
    step_time_s: float = 0.0  # the last step's wall time (the worker's step-time estimate)


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    kwargs: dict
    future: concurrent.futures.Future


class AsyncEngine:
    """``engine`` stepped on the torch thread (see the module docstring). Hooks, all settable later:

    * ``on_outputs(outputs)`` — on the event loop, with each step's outputs.
    * ``on_step(batched tokens, sequences)`` — on the torch thread after each step (cheap and
      thread-safe, e.g. a prometheus histogram observe).
    * ``before_step()`` — on the torch thread right before each ``engine.step()``. Tests use it to
      pace or slow the step loop (a ``time.sleep`` here releases the GIL like a real forward pass)
      instead of replacing ``engine.step``; production passes nothing.
    """

    def __init__(self, engine: Engine, on_outputs: Callable[[list[RequestOutput]], None] | None = None,
                 max_commands: int = 4096, *, before_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_outputs = on_outputs  # called on the event loop with each step's outputs; settable
        self.before_step = before_step
        # Called on the torch thread after each step with (batched tokens, sequences); must be
        # cheap and thread-safe (e.g. a prometheus histogram observe).
        self.on_step: Callable[[int, int], None] | None = None
        self._commands: queue.Queue[_Add] = queue.Queue(maxsize=max_commands)
        self._aborts: collections.deque[str] = collections.deque()
        self._sched = threading.Lock()  # guards _started and _scheduled
        self._started = False
        self._scheduled = False  # a turn of the step loop is queued or running on the torch thread
        self._idle = threading.Event()  # set while no turn is
        self._idle.set()
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._compiling: dict[str, bool] = {}  # request id -> aborted, while its grammar compiles
        self._compile_lock = threading.Lock()
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)
        self._adds_applied = 0  # torch thread only: add commands taken from the queue
        self._gpu_mem: tuple[float, float | None] = (float("-inf"), None)  # (when read, value)
        self.snapshot = EngineSnapshot(max_num_seqs=engine.config.max_num_seqs,
                                       kv_blocks_total=engine.kv.num_blocks, kv_blocks_free=engine.kv.num_free_blocks)
        self.error: BaseException | None = None
        self._crash: asyncio.Future | None = None  # resolves to the step loop's crash (start() makes it)

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        self._crash = self._loop.create_future()
        with self._sched:
            self._started = True
        self._kick()  # what was submitted before the start

    async def stop(self) -> None:
        if not self._started:
            return
        self._stopping.set()
        await asyncio.to_thread(self._idle.wait)
        with self._sched:
            self._started = False

    async def crashed(self) -> BaseException:
        """Wait until the step loop crashes (a tensor-parallel rank died, a kernel failed); returns
        the exception. The worker watches this to stop and exit non-zero."""
        assert self._crash is not None, "start() first"
        return await asyncio.shield(self._crash)

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- commands ---------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt=None, params: SamplingParams | None = None, **kwargs) -> concurrent.futures.Future:
        """Queue a request; the future resolves once it is in the engine, to the number of add
        commands applied so far (its own included; see ``EngineSnapshot.adds_applied``), or raises
        the engine's ``ValueError`` for bad input. Raises ``queue.Full`` if the command queue is full."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        add = _Add(request_id, dict(prompt=prompt, params=params, **kwargs), fut)
        spec = params.guided if isinstance(params, SamplingParams) else None
        compiling = self.engine.compile_async(spec) if spec is not None else None
        if compiling is not None and not compiling.done():
            # Structured output: the grammar compiles on the grammar pool, not between two steps;
            # the request enters the engine once it has compiled (the batch never waits for it).
            if self._commands.full():
                raise queue.Full
            with self._compile_lock:
                self._compiling[request_id] = False
            compiling.add_done_callback(lambda _f: self._compiled(add))
            return fut
        self._commands.put_nowait(add)
        self._kick()
        return fut

    def _compiled(self, add: _Add) -> None:
        """On a grammar-pool thread: queue the request whose grammar is ready (a compile error
        comes back from ``add_request`` through its future), then its abort if one came meanwhile."""
        with self._compile_lock:
            aborted = self._compiling.pop(add.request_id, False)
        try:
            self._commands.put(add, timeout=5.0)
            if aborted:
                self._aborts.append(add.request_id)
        except queue.Full as exc:
            if add.future.set_running_or_notify_cancel():
                add.future.set_exception(exc)
        self._kick()

    async def add_request(self, request_id: str, prompt=None, params: SamplingParams | None = None, **kwargs) -> None:
        await asyncio.wrap_future(self.submit(request_id, prompt, params, **kwargs))

    def abort(self, request_id: str) -> None:
        with self._compile_lock:
            if request_id in self._compiling:  # its grammar is compiling: abort once it is queued
                self._compiling[request_id] = True
                return
        # Aborts bypass the bounded command queue (an unbounded deque, appended from any thread): a
        # full queue must never stop a cancel, a rebalance or a deadline from freeing KV.
        self._aborts.append(request_id)
        self._kick()

    async def generate(self, request_id: str, prompt=None, params: SamplingParams | None = None, **kwargs) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs. Cancelling the iteration aborts the request."""
        params = params or SamplingParams()
        # Unbounded on purpose: the engine bounds it (<= 1 output per token + a final), and a
        # maxsize only turned that into a QueueFull raised on the event loop by whichever put came
        # last (``_deliver``, or ``_fail_all`` when the engine crashes), losing the crash for the
        # streams after it.
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        try:
            await self.add_request(request_id, prompt, params, **kwargs)
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        except BaseException:
            self.abort(request_id)
            raise
        finally:
            self._streams.pop(request_id, None)

    # -- the step loop, on the torch thread -------------------------------------------------------

    def _kick(self) -> None:
        """Any thread: make sure a turn of the step loop is queued or running (one at most)."""
        with self._sched:
            if self._scheduled or not self._started or self._stopping.is_set() or self.error is not None:
                return
            self._scheduled = True
            self._idle.clear()
        torch_thread.post(self._turn)

    def _drain_commands(self) -> None:
        """Adds, then aborts: an abort always follows its request's add (the caller submitted it
        first), so draining the adds first never leaves an abort for a request not yet added."""
        self._drain_adds()
        while self._aborts:
            self.engine.abort(self._aborts.popleft())

    def _drain_adds(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if not cmd.future.set_running_or_notify_cancel():
                continue
            self._adds_applied += 1
            try:
                self.engine.add_request(cmd.request_id, **cmd.kwargs)
            except Exception as exc:  # bad input: tell the caller, keep serving
                cmd.future.set_exception(exc)
            else:
                cmd.future.set_result(self._adds_applied)

    def _turn(self) -> None:
        """One turn of the step loop (a job of the torch thread); a crash fails everything loudly."""
        try:
            more = self._steps()
        except BaseException as exc:
            log.exception("engine step loop crashed")
            self.error = exc  # set before the turn ends: no command posts another
            self._end_turn()
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, exc)
            return
        if more:
            torch_thread.post(self._turn)  # behind the job that waits: still this engine's turn next

    def _end_turn(self) -> None:
        with self._sched:
            self._scheduled = False
            self._idle.set()

    def _steps(self) -> bool:
        """Apply the commands and step back to back while there is work (handing each step to the
        torch thread on its own cost a thread wake-up a step, and on cores busy with the bus each
        wake-up waited for a core, adding up over a batch: docs/design.md, "One torch thread").
        Returns True when it yields to another job of the torch thread with work left, False once
        the turn has ended (idle, stopping)."""
        while True:
            self._drain_commands()  # between two steps: aborts free KV here
            if self._stopping.is_set():
                self._end_turn()
                return False
            if not self.engine.has_unfinished():
                with self._sched:  # a command queued after the drain finds _scheduled set: take it
                    if self._commands.empty() and not self._aborts:
                        self._scheduled = False
                        self._idle.set()
                        return False
                continue
            steps_before = self.engine.stats.steps
            if self.before_step is not None:
                self.before_step()
            t0 = time.monotonic()
            outputs = self.engine.step()
            self._update_snapshot(time.monotonic() - t0)
            if self.on_step is not None and self.engine.stats.steps > steps_before:
                self.on_step(self.engine.stats.last_batch_tokens, self.engine.stats.last_batch_seqs)
            if outputs:
                assert self._loop is not None  # set by start(), before the first turn
                self._loop.call_soon_threadsafe(self._deliver, outputs)
            if torch_thread.others_waiting():
                return True

    def _update_snapshot(self, step_time_s: float = 0.0) -> None:
        e = self.engine
        now = time.monotonic()
        self._rate.append((now, e.stats.generated_tokens))
        t0, n0 = self._rate[0]
        rate = (e.stats.generated_tokens - n0) / (now - t0) if now > t0 else 0.0
        if e.device.type == "cuda" and now - self._gpu_mem[0] >= 1.0:
            self._gpu_mem = (now, gpu_memory_utilization(e.device))
        self.snapshot = EngineSnapshot(
            running=e.num_running(), waiting=e.num_waiting(), kv_blocks_total=e.kv.num_blocks,
            kv_blocks_free=e.kv.num_free_blocks, kv_usage=e.kv.usage(), prefix_queries=e.kv.stats.queries,
            prefix_hits=e.kv.stats.hits, preemptions=e.stats.preemptions, steps=e.stats.steps,
            prompt_tokens=e.stats.prompt_tokens, generated_tokens=e.stats.generated_tokens,
            last_batch_tokens=e.stats.last_batch_tokens, last_batch_seqs=e.stats.last_batch_seqs,
            tokens_per_s=rate, max_num_seqs=e.config.max_num_seqs, gpu_memory_utilization=self._gpu_mem[1],
            spec_num_drafts=e.stats.spec_num_drafts, spec_num_draft_tokens=e.stats.spec_num_draft_tokens,
            spec_num_accepted_tokens=e.stats.spec_num_accepted_tokens,
            kv_blocks_to_prefill=e.scheduler.blocks_to_prefill(), adds_applied=self._adds_applied,
            step_time_s=step_time_s, **e.lora_snapshot(),
        )

    # -- event-loop side --------------------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
        if self.on_outputs is not None:
            self.on_outputs(outputs)

    def _fail_all(self, exc: BaseException) -> None:
        """Every open stream ends with the crash, after the outputs it already holds. Never raises
        (the streams are unbounded), so no stream is left waiting for an output that never comes."""
        if self._crash is not None and not self._crash.done():
            self._crash.set_result(exc)
        for stream in self._streams.values():
            stream.put_nowait(RuntimeError(f"engine crashed: {exc!r}"))
