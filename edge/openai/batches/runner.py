"""Runs batches: each line through the live endpoint's own code, at tier 2, on the bus.

Who runs a batch: the edges form one consumer group on the batches table's topic
(``<ns>.batch-runners``); an edge runs the active batches whose id falls in a partition the group
assigned it. An edge that stops (or dies: its session times out) loses its partitions and another
edge takes them up and resumes their batches; nothing of a batch lives only in one edge.

A line runs as the request its endpoint would receive (:data:`Dispatch`: the route's ``answer``,
given the decoded body and the batch owner's principal at tier 2): the same parsing, the same
refusals (a bad sampling value, an unknown model, bad messages: the error file gets the status and
body the live endpoint answers), the same admission (key, limits, shedding, fair-share weight),
the same bus path and exact resume after a worker dies. A 429 or 503 (limits, shedding: live
traffic comes first) with a ``Retry-After`` is retried after it until the batch expires.

Exactly once per line: every answer is appended to the results log before it counts; a runner
(re)starting a batch reads the log and runs only the lines without a record; the output and error
files are built from the log (the first record of each line) under ids derived from the batch id,
so finalizing twice writes the same files. Requests in flight when an edge stops are cancelled
(its ``with adm.streams()`` blocks end) and run again by the next runner.

Status: validating -> in_progress -> finalizing -> completed; validating -> failed; a cancel
(``cancel/<id>`` in the table, written by any edge) -> cancelling -> cancelled; past
``expires_at`` -> expired. Lines never run (cancelled, expired) are in the error file with
``batch_cancelled`` / ``batch_expired``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from aiohttp import web

from bus import Consumer, Tier, TopicPartition
from edge.admission.auth import Principal
from edge.admission.gate import Admission
from edge.openai.batches.model import (
    ACTIVE,
    BatchObject,
    Counts,
    InputLine,
    answered_record,
    jsonl,
    parse_input,
    unrun_record,
    validation_error,
)
from edge.openai.batches.store import BatchStore, LineResult

log = logging.getLogger(__name__)

Dispatch = Callable[[Any, Principal], Awaitable[web.StreamResponse]]
RETRY = (429, 503)
SCAN_S = 0.25
PROGRESS_S = 0.5
RETRY_FAILED_S = 5.0


def output_ids(batch_id: str) -> tuple[str, str]:
    """The output and error files' ids: fixed by the batch, so a second finalization overwrites."""
    return f"file-{batch_id[6:]}-output", f"file-{batch_id[6:]}-errors"


class BatchRunner:
    def __init__(self, adm: Admission, store: BatchStore, dispatch: Mapping[str, Dispatch],
                 max_in_flight: int = 8) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.adm = adm
        self.store = store
        self.dispatch = dispatch
        self.max_in_flight = max_in_flight
        self.group = f"{adm.config.layout.namespace}.batch-runners"
        self.owned: set[int] = set()
        self.running: dict[str, asyncio.Task] = {}
        self._retry_at: dict[str, float] = {}  # batch id -> when to try again after its runner failed
        self._consumer: Consumer | None = None
        self._task: asyncio.Task | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._consumer = self.adm.bus.consumer([self.store.batches.topic], group_id=self.group, start_from="latest",
                                               on_assigned=self._assigned, on_revoked=self._revoked)
        await self._consumer.start()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        task, self._task = self._task, None
        tasks = [t for t in (task, *self.running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.running.clear()
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    def _assigned(self, tps: set[TopicPartition]) -> None:
        self.owned |= {tp.partition for tp in tps}

    def _revoked(self, tps: set[TopicPartition]) -> None:
        gone = {tp.partition for tp in tps}
        self.owned -= gone
        for bid, t in list(self.running.items()):
            if self.store.batch_partition(bid) in gone:
                t.cancel()  # its in-flight lines are cancelled; the new owner resumes from the log

    async def _loop(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                await self._consumer.getmany(timeout_ms=int(SCAN_S * 1000))  # membership; the table has the data
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("batch runner: group read failed: %s", exc)
                await asyncio.sleep(1.0)
            now = time.monotonic()
            for b in self.store.all_batches():
                if b.status in ACTIVE and b.id not in self.running and self.store.batch_partition(b.id) in self.owned \
                        and self._retry_at.get(b.id, 0.0) <= now:
                    t = asyncio.get_running_loop().create_task(self._run(b.id), name=f"batch:{b.id}")
                    self.running[b.id] = t
                    t.add_done_callback(functools.partial(self._ended, b.id))

    def _ended(self, bid: str, t: asyncio.Task) -> None:
        if self.running.get(bid) is t:
            del self.running[bid]
        if not t.cancelled() and t.exception() is not None:
            # a bus outage, a blob not readable yet: try again later, not in a tight loop
            log.error("batch %s: runner failed (retried in %g s)", bid, RETRY_FAILED_S, exc_info=t.exception())
            self._retry_at[bid] = time.monotonic() + RETRY_FAILED_S
        else:
            self._retry_at.pop(bid, None)

    # --- one batch ----------------------------------------------------------------------------
    async def _run(self, bid: str) -> None:
        store = self.store
        b = store.batch(bid)
        if b is None or b.status not in ACTIVE:
            return
        who = self.adm.auth.by_hash(b.key_hash)
        f = store.file(b.tenant, b.input_file_id)
        if who is None or f is None:
            why = "the API key that created the batch is no longer valid" if who is None else \
                "the input file was deleted before the batch ran"
            await store.put_batch(b.moved("failed", _now(), errors=(validation_error("batch_failed", why),)))
            return
        # a file of up to --max-file-bytes: parsed off the event loop, which serves live traffic
        lines, errors = await asyncio.to_thread(parse_input, await store.content(f), b.endpoint)
        if b.status == "validating":
            if errors:
                await store.put_batch(b.moved("failed", _now(), errors=tuple(errors)))
                return
            b = b.moved("in_progress", _now(), counts=Counts(len(lines)))
            await store.put_batch(b)
        done = await store.results(b)
        if b.status == "in_progress":
            await self._run_lines(b, lines, done, Principal(who.entry, tier_override=int(Tier.P2)))
        await self._finalize(bid, lines, done)

    def _stopping(self, b: BatchObject) -> str | None:
        """Why the batch stops running lines: ``cancelling``, ``expired``, or None."""
        if self.store.cancelled_at(b.id) is not None:
            return "cancelling"
        return "expired" if time.time() >= (self.store.batch(b.id) or b).expires_at else None

    async def _run_lines(self, b: BatchObject, lines: list[InputLine], done: dict[int, LineResult],
                         who: Principal) -> None:
        todo = iter([ln for ln in lines if ln.line not in done])
        dirty = asyncio.Event()

        async def worker() -> None:
            """One of ``max_in_flight``: takes the next line until none is left (a bounded pool,
            not one task per line: a batch may hold 50,000)."""
            for line in todo:
                if self._stopping(b) is not None:
                    return
                r = await self._line(b, line, who)
                await self.store.add_result(b.id, r)  # in the log before it counts
                done.setdefault(r.line, r)
                dirty.set()

        async def progress() -> None:
            shown = -1
            while True:
                await dirty.wait()
                dirty.clear()
                if len(done) != shown:
                    shown = len(done)
                    cur = self.store.batch(b.id) or b
                    if cur.status == "in_progress":
                        await self.store.put_batch(replace(cur, counts=_counts(len(lines), done)))
                await asyncio.sleep(PROGRESS_S)

        tasks = [asyncio.create_task(worker()) for _ in range(self.max_in_flight)]
        reporter = asyncio.create_task(progress())
        try:
            pending = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=SCAN_S)
                if pending and self._stopping(b) is not None:
                    for t in pending:
                        t.cancel()  # leaving the route's ``with adm.streams()`` cancels the request on the bus
                    await asyncio.gather(*pending, return_exceptions=True)
                    break
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            reporter.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(reporter, *tasks, return_exceptions=True)

    async def _line(self, b: BatchObject, line: InputLine, who: Principal) -> LineResult:
        if line.body.get("stream"):
            refused = {"error": {"message": "stream is not supported in a batch request",
                                 "type": "invalid_request_error", "param": "stream", "code": None}}
            return LineResult(line.line, False, answered_record(b.id, line, 400, refused, f"{b.id}-{line.line}"))
        delay = 0.5
        while True:
            resp = await self.dispatch[b.endpoint](dict(line.body), who)
            status = resp.status
            raw = resp.body if isinstance(resp, web.Response) else None
            body = json.loads(raw) if isinstance(raw, (bytes, bytearray)) else None
            after = resp.headers.get("Retry-After")
            # a 429/503 with Retry-After passes later (a rate, shedding, the bus back); without one it
            # never will (a request larger than the key's tokens_per_min): that is the line's answer
            if status in RETRY and after is not None and time.time() < b.expires_at:
                await asyncio.sleep(min(30.0, float(after) if after else delay))
                delay = min(delay * 2, 30.0)
                continue
            rid = body.get("id") if status == 200 and isinstance(body, dict) and body.get("id") else f"{b.id}-{line.line}"
            return LineResult(line.line, status == 200, answered_record(b.id, line, status, body, str(rid)))

    async def _finalize(self, bid: str, lines: list[InputLine], done: dict[int, LineResult]) -> None:
        store = self.store
        b = store.batch(bid)
        if b is None or b.status not in ACTIVE:
            return
        stop = self._stopping(b) if len(done) < len(lines) else None
        if stop is None and b.status != "finalizing":
            b = b.moved("finalizing", _now())
            await store.put_batch(b)
        code = {"cancelling": "batch_cancelled", "expired": "batch_expired"}.get(stop or "", "batch_failed")
        why = {"cancelling": "the batch was cancelled before this request ran",
               "expired": "the batch expired before this request ran"}.get(stop or "", "the request did not run")
        ok: list[dict[str, Any]] = []
        bad: list[dict[str, Any]] = []
        for ln in lines:
            r = done.get(ln.line)
            if r is None:
                bad.append(unrun_record(b.id, ln, code, why))
            else:
                (ok if r.ok else bad).append(r.record)
        out_id, err_id = output_ids(b.id)
        ok_data, bad_data = await asyncio.to_thread(jsonl, ok), await asyncio.to_thread(jsonl, bad)
        out = (await store.add_file(b.tenant, out_id, f"{b.id}_output.jsonl", "batch_output", ok_data)).id if ok else None
        err = (await store.add_file(b.tenant, err_id, f"{b.id}_error.jsonl", "batch_output", bad_data)).id if bad else None
        final = {"cancelling": "cancelled", "expired": "expired"}.get(stop or "", "completed")
        await store.put_batch(b.moved(final, _now(), output_file_id=out, error_file_id=err,
                                      counts=Counts(len(lines), len(ok), len(bad))))


def _counts(total: int, done: dict[int, LineResult]) -> Counts:
    ok = sum(1 for r in done.values() if r.ok)
    return Counts(total, ok, len(done) - ok)


def _now() -> int:
    return int(time.time())


__all__ = ["BatchRunner", "Dispatch", "output_ids"]

