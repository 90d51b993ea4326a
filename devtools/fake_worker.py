"""A synthetic worker for tests and ``lockgate bench edge``: no model, deterministic tokens.

It speaks the real worker's bus contract: consumes the model's priority topics (group
``lockgate-fake-workers``), publishes one :class:`TokenChunk` per output token to each request's
``reply_to``, then :class:`Finished`, through the real worker's :class:`ReplySender` (so a step's
replies for one reply partition travel as one record, as from a real worker); honours
:class:`Cancel` from the control topic (publishes ``Finished(abort)``); publishes
:class:`WorkerStatus` heartbeats.

Output of a request is a pure function of its prompt and ``max_tokens`` (see :func:`expected_text`),
so tests can compare what a client received. Knobs for tests: ``step_s`` (delay between steps; each
step emits one token for every running request), ``replay_after`` (after that many tokens, behave
like a restarted worker: re-send from seq 0 with ``attempt + 1``; with ``diverge_on_replay`` the
re-run's token ids differ, as an unseeded re-run's would), ``est_wait_s`` / ``queue_depth``
(mutable, reported in heartbeats), ``token_text`` (custom token text, e.g. publish timestamps for
latency benchmarks), ``error`` (answer every request with this error code), ``step_phase_s``
(step on a fixed grid of the monotonic clock, offset by this phase: several fake workers with
spread phases behave like a fleet whose steps are not synchronised).

All tasks are owned: ``start()`` creates them, ``stop()`` cancels and awaits them (idempotent).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from bus import (
    Bus,
    Cancel,
    Consumer,
    DecodeError,
    Error,
    Finished,
    FinishReason,
    InferenceRequest,
    Timings,
    TopicLayout,
    Usage,
    WorkerStatus,
    decode,
    encode,
)
from edge.admission.router import checkpoint
from engine_workers.worker.replies.sender import ReplySender

log = logging.getLogger(__name__)

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café", "🙂", "世界")


def token_piece(prompt_ids: tuple[int, ...], i: int) -> str:
    return WORDS[(sum(prompt_ids) + i) % len(WORDS)] + " "


def expected_text(prompt_ids: tuple[int, ...], n: int) -> str:
    return "".join(token_piece(prompt_ids, i) for i in range(n))


class _Run:
    __slots__ = ("req", "pos", "attempt", "replayed", "texts_len", "started")

    def __init__(self, req: InferenceRequest) -> None:
        self.req = req
        self.pos = 0
        self.attempt = req.attempt
        self.replayed = False
        self.texts_len = 0
        self.started = time.time()


class FakeWorker:
    def __init__(
        self,
        bus: Bus,
        model: str,
        layout: TopicLayout | None = None,
        worker_id: str = "fake-0",
        step_s: float = 0.0,
        heartbeat_s: float = 0.2,
        replay_after: int | None = None,
        token_text: Callable[[tuple[int, ...], int], str] | None = None,
        error: str | None = None,
        heartbeats: bool = True,
        step_phase_s: float | None = None,
        diverge_on_replay: bool = False,
        first_token_s: float = 0.0,
        stop_after: int | None = None,
        loras: tuple[str, ...] = (),  # LoRA adapter names its heartbeats list (the edge routes them here)
    ) -> None:
        self.loras = loras
        self.bus = bus
        self.model = model
        self.layout = layout or TopicLayout()
        self.worker_id = worker_id
        self.step_s = step_s
        self.heartbeat_s = heartbeat_s
        self.replay_after = replay_after
        self.diverge_on_replay = diverge_on_replay
        self.token_text = token_text or token_piece
        self.error = error
        self.heartbeats = heartbeats
        if step_phase_s is not None and not 0 <= step_phase_s < max(step_s, 1e-9):
            raise ValueError(f"step_phase_s must be in [0, step_s), got {step_phase_s}")
        self.step_phase_s = step_phase_s
        self.first_token_s = first_token_s
        self.stop_after = stop_after  # end each request with "stop" after this many tokens (as at a stop string)
        self._prefills: set[asyncio.TimerHandle] = set()  # owned: cancelled by stop()
        self.est_wait_s: list[float] = [0.0, 0.0, 0.0]
        self.queue_depth: list[int] = [0, 0, 0]
        self.running: dict[str, _Run] = {}
        self.seen: list[InferenceRequest] = []  # every request received (tests inspect it)
        self.cancels: list[Cancel] = []
        self.tokens_sent = 0
        self.replies = ReplySender(bus, worker_id)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._started = False

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        await self.bus.ensure_topics(self.layout.model_specs(self.model))
        reqs = self.bus.consumer(self.layout.request_topics(self.model), group_id="lockgate-fake-workers",
                                 start_from="earliest")
        ctrl = self.bus.consumer([self.layout.control_topic], start_from="latest")
        await reqs.start()
        await ctrl.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._consume(reqs)), loop.create_task(self._control(ctrl)),
                       loop.create_task(self._generate())]
        if self.heartbeats:
            self._tasks.append(loop.create_task(self._heartbeat()))

    async def stop(self) -> None:
        for h in self._prefills:
            h.cancel()
        self._prefills.clear()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.replies.stop()

    async def __aenter__(self) -> FakeWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def send_status(self) -> None:
        st = WorkerStatus(self.worker_id, self.model, time.time(), tuple(self.queue_depth), tuple(self.est_wait_s),
                          running=len(self.running), max_num_seqs=256, loras=self.loras)
        await self.bus.send(self.layout.status_topic, encode(st), key=self.worker_id.encode())

    async def _heartbeat(self) -> None:
        while True:
            await self.send_status()
            await asyncio.sleep(self.heartbeat_s)

    async def _consume(self, consumer: Consumer) -> None:
        try:
            while True:
                records = await consumer.getmany(timeout_ms=200)
                checkpoint()
                for rec in records:
                    try:
                        req = decode(rec.value)
                    except DecodeError:
                        continue
                    if not isinstance(req, InferenceRequest):
                        continue
                    self.seen.append(req)
                    if self.error:
                        await self.bus.send(req.reply_to, encode(Error(req.request_id, self.error, "fake error")),
                                            key=req.request_id.encode())
                        continue
                    if self.first_token_s > 0:
                        loop = asyncio.get_running_loop()
                        h = loop.call_later(self.first_token_s, self._run, req)
                        self._prefills.add(h)
                    else:
                        self._run(req)
        finally:
            await consumer.stop()

    def _run(self, req: InferenceRequest) -> None:
        self._prefills = {h for h in self._prefills if not h.cancelled() and h.when() > asyncio.get_running_loop().time()}
        self.running[req.request_id] = _Run(req)
        self._wake.set()

    async def _control(self, consumer: Consumer) -> None:
        try:
            while True:
                records = await consumer.getmany(timeout_ms=200)
                checkpoint()
                for rec in records:
                    try:
                        msg = decode(rec.value)
                    except DecodeError:
                        continue
                    if isinstance(msg, Cancel):
                        self.cancels.append(msg)
                        run = self.running.pop(msg.request_id, None)
                        if run is not None:
                            self._finish(run, FinishReason.ABORT)
        finally:
            await consumer.stop()

    def _finish(self, run: _Run, reason: str) -> None:
        req = run.req
        fin = Finished(req.request_id, run.attempt, reason, run.pos,
                       Usage(len(req.prompt_token_ids), run.pos), Timings(e2e=time.time() - run.started),
                       self.worker_id)
        self.replies.final(self._key(run), req.reply_to, req.request_id, fin, lambda: None)

    @staticmethod
    def _key(run: _Run) -> str:
        # One ReplySender key per attempt, as the real worker has one per fetched record: a replay
        # re-sends from seq 0, which must not be glued onto the previous attempt's queued tokens.
        return f"{run.req.request_id}/{run.attempt}"

    def _first_step_at(self, now: float) -> float:
        """Without a phase, at once; with one, the next instant ``phase + k * step_s`` of the loop
        clock (the system's monotonic clock, to the millisecond on uvloop: shared by every process
        of the machine, so fake workers in different processes keep their phases)."""
        if self.step_phase_s is None or self.step_s <= 0:
            return now
        k = math.ceil((now - self.step_phase_s) / self.step_s)
        return self.step_phase_s + k * self.step_s

    async def _generate(self) -> None:
        # Fixed-rate steps (every step_s from the previous step's start, not step_s after its end),
        # so the offered load is len(running) / step_s; a step that overruns starts the next at once
        # (with a phase: at the next point of its grid, skipping the missed ones).
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                next_at = self._first_step_at(loop.time())
                if next_at > loop.time():
                    await asyncio.sleep(next_at - loop.time())
            for rid, run in list(self.running.items()):
                if rid not in self.running:
                    continue
                req = run.req
                if self.replay_after is not None and not run.replayed and run.pos == self.replay_after:
                    self.replies.drop(self._key(run))  # like a crash: what was not yet sent is lost
                    run.replayed, run.pos, run.texts_len, run.attempt = True, 0, 0, run.attempt + 1
                i = run.pos
                text = self.token_text(req.prompt_token_ids, i)
                token = i % 200 + 3 + (run.attempt - req.attempt if self.diverge_on_replay else 0)
                self.replies.chunk(self._key(run), req.reply_to, rid, run.attempt, i, (token,), text,
                                   run.texts_len)
                self.tokens_sent += 1
                run.pos += 1
                run.texts_len += len(text)
                if run.pos >= req.sampling.max_tokens:
                    del self.running[rid]
                    self._finish(run, FinishReason.LENGTH)
                elif self.stop_after is not None and run.pos >= self.stop_after:
                    del self.running[rid]
                    self._finish(run, FinishReason.STOP)
            next_at += self.step_s
            delay = next_at - loop.time()
            if delay < 0:
                # Overran (or the loop stalled): without a phase, step again at once; with one,
                # at the next grid point, so a stall cannot leave a fleet stepping in lockstep.
                next_at = self._first_step_at(loop.time())
                delay = max(0.0, next_at - loop.time())
            await asyncio.sleep(delay)
