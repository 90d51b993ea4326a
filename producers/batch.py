"""``lockgate batch run``: an OpenAI-Batch-format job over the bus, resumable.

Flow: read the output file first (what is already done; a torn last line is cut off), parse the
input (:mod:`producers.openai_batch`), write error records for bad lines, then publish the rest at
tier 2 (batch) to the model's priority topic with the job's own reply topic
(``TopicLayout.reply_topic("job-" + job_id)``), at most ``max_in_flight`` at once, and append one
output line per finished request.

Crash safety: every output record is one ``write`` of a complete line on an unbuffered file, so a
crash leaves at most one torn last line, which the next run cuts off. A rerun skips every
custom_id already in the output and redoes the rest, so the finished output has exactly one record
per input line. Request ids are ``<job_id>.<run nonce>.<line>``: replies to an earlier (killed)
run's requests are ignored by the collector. The default job id is derived from the output path,
so a rerun uses the same reply topic.

Cancellation: cancelling :func:`run_batch` (Ctrl-C) cancels its tasks, publishes a best-effort
``Cancel`` for every request in flight, stops the collector and closes the file; whatever was
written stays valid.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bus import Bus, Cancel, ErrorCode, InferenceRequest, Tier, TopicLayout, encode
from producers.collector import ReplyCollector
from producers.openai_batch import (
    DEFAULT_MAX_TOKENS,
    BadLine,
    BatchRequest,
    Completion,
    bad_line_record,
    dumps_record,
    failed_record,
    plan,
    result_record,
    scan_output,
)
from producers.progress import ProgressBar
from producers.prompting import Tokenizer

log = logging.getLogger(__name__)

RETRYABLE = (ErrorCode.OVERLOADED, ErrorCode.RATE_LIMITED)


@dataclass(frozen=True, slots=True)
class BatchConfig:
    input: Path
    output: Path
    bus_url: str
    model: str
    max_in_flight: int = 64
    job_id: str | None = None
    layout: TopicLayout = field(default_factory=TopicLayout)
    request_timeout_s: float = 600.0
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_retries: int = 5
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")

    @property
    def job(self) -> str:
        return self.job_id or default_job_id(self.output)


@dataclass(frozen=True, slots=True)
class BatchSummary:
    total: int  # records the finished output holds
    skipped: int  # already in the output before this run
    results: int  # successful responses written by this run
    failed: int  # platform errors written by this run
    bad_lines: int  # error records for bad lines written by this run
    output_tokens: int
    seconds: float

    @property
    def written(self) -> int:
        return self.results + self.failed + self.bad_lines


def default_job_id(output: Path) -> str:
    return hashlib.sha1(str(Path(output).resolve()).encode()).hexdigest()[:12]


class OutputFile:
    """Append-only output. ``open`` cuts a torn last line; ``write`` is one ``os.write`` of a
    complete line (looped only if the kernel writes short), then ``fsync`` when asked."""

    def __init__(self, path: Path, valid_bytes: int, fsync: bool = False) -> None:
        self.path = path
        self.fsync = fsync
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self.fd, valid_bytes)
        os.lseek(self.fd, 0, os.SEEK_END)

    def write(self, record: dict) -> None:
        data = dumps_record(record)
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        if self.fsync:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BatchJob:
    """One run of a job. Use :func:`run_batch`."""

    def __init__(self, cfg: BatchConfig, bus: Bus, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.bus = bus
        self.tok = tokenizer
        self.nonce = secrets.token_hex(3)
        self.reply_topic = cfg.layout.reply_topic("job-" + cfg.job)
        self.request_topic = cfg.layout.request_topic(cfg.model, Tier.P2)
        self.in_flight: set[str] = set()
        self.results = self.failed = self.bad = self.tokens = 0
        self.out: OutputFile | None = None
        self.bar: ProgressBar | None = None
        self.collector: ReplyCollector | None = None

    async def run(self) -> BatchSummary:
        cfg = self.cfg
        t0 = time.monotonic()
        existing = cfg.output.read_bytes() if cfg.output.exists() else b""
        done = scan_output(existing)
        lines = cfg.input.read_text(encoding="utf-8", errors="replace").splitlines()
        todo, total = plan(lines, done, cfg.default_max_tokens)
        skipped = total - len(todo)
        self.out = OutputFile(cfg.output, done.valid_bytes)
        self.bar = ProgressBar(total, skipped, label=f"job {cfg.job}", enabled=cfg.progress)
        try:
            runnable: list[BatchRequest] = []
            for item in todo:
                if isinstance(item, BadLine):
                    self._write(bad_line_record(item, cfg.job))
                    self.bad += 1
                else:
                    runnable.append(item)
            if runnable:
                await self._run_requests(runnable)
        finally:
            self.out.close()
            self.bar.close()
        return BatchSummary(total, skipped, self.results, self.failed, self.bad, self.tokens, time.monotonic() - t0)

    def _write(self, record: dict, tokens: int = 0) -> None:
        assert self.out is not None and self.bar is not None
        self.out.write(record)
        self.tokens += tokens
        self.bar.update(1, tokens)

    async def _run_requests(self, reqs: list[BatchRequest]) -> None:
        cfg = self.cfg
        await self.bus.ensure_topics(cfg.layout.model_specs(cfg.model) + [cfg.layout.reply_spec("job-" + cfg.job)])
        self.collector = ReplyCollector(self.bus, self.reply_topic, start_from="latest")
        await self.collector.start()
        sem = asyncio.Semaphore(cfg.max_in_flight)
        tasks: set[asyncio.Task] = set()
        failures: list[BaseException] = []

        def done_cb(t: asyncio.Task) -> None:
            tasks.discard(t)
            sem.release()
            exc = None if t.cancelled() else t.exception()
            if exc is not None:
                failures.append(exc)

        loop = asyncio.get_running_loop()
        try:
            for req in reqs:
                await sem.acquire()
                if failures:
                    raise failures[0]
                t = loop.create_task(self._one(req))
                tasks.add(t)
                t.add_done_callback(done_cb)
            while tasks:
                await asyncio.wait(set(tasks))
            if failures:
                raise failures[0]
        finally:
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._cancel_in_flight()
            await self.collector.retire()  # the job's reply topic, unless a request may still answer

    async def _cancel_in_flight(self) -> None:
        ids, self.in_flight = list(self.in_flight), set()
        if not ids:
            return
        topic = self.cfg.layout.control_topic

        async def send_all() -> None:
            for rid in ids:
                await self.bus.send(topic, encode(Cancel(rid, "batch-job-stopped")), key=rid.encode())
        try:
            await asyncio.wait_for(send_all(), 5.0)
        except Exception as exc:  # best effort: workers finish them, replies are ignored
            log.warning("could not cancel %d in-flight requests: %s", len(ids), exc)

    async def _one(self, req: BatchRequest) -> None:
        cfg = self.cfg
        try:
            if req.prompt_token_ids is not None:
                ids = list(req.prompt_token_ids)
            elif req.messages is not None:
                ids = self.tok.chat(req.messages)
            else:
                ids = self.tok.text(req.prompt or "")
        except ValueError as exc:
            self._write(bad_line_record(BadLine(req.line, req.custom_id, f"line {req.line}: {exc}"), cfg.job))
            self.bad += 1
            return
        max_tokens = self.tok.room(len(ids), req.sampling.max_tokens)
        sampling = req.sampling if max_tokens == req.sampling.max_tokens else replace(req.sampling, max_tokens=max_tokens)
        sampling = sampling.seeded()  # a retry re-runs with the same seed
        for attempt in range(cfg.max_retries + 1):
            rid = f"{cfg.job}.{self.nonce}.{req.line}" + (f".r{attempt}" if attempt else "")
            ir = InferenceRequest(request_id=rid, model=cfg.model, prompt_token_ids=tuple(ids), sampling=sampling,
                                  reply_to=self.reply_topic, tenant=f"batch:{cfg.job}", tier=int(Tier.P2),
                                  enqueued_at=time.time(), prompt_text=req.prompt, messages=req.messages)
            assert self.collector is not None
            fut = self.collector.expect(rid)
            self.in_flight.add(rid)
            try:
                await self.bus.send(self.request_topic, encode(ir), key=rid.encode())
                reply = await asyncio.wait_for(fut, cfg.request_timeout_s)
            except TimeoutError:
                self.collector.forget(rid)
                await self.bus.send(cfg.layout.control_topic, encode(Cancel(rid, "timeout")), key=rid.encode())
                self._write(failed_record(req, rid, ErrorCode.EXPIRED, f"no reply within {cfg.request_timeout_s:g}s"))
                self.failed += 1
                return
            finally:
                self.in_flight.discard(rid)
            if reply.error is not None:
                if reply.error.code in RETRYABLE and attempt < cfg.max_retries:
                    await asyncio.sleep(min(30.0, reply.error.retry_after or 2.0 ** attempt))
                    continue
                self._write(failed_record(req, rid, reply.error.code, reply.error.message))
                self.failed += 1
                return
            fin = reply.finished
            assert fin is not None
            if fin.finish_reason == "abort":
                self._write(failed_record(req, rid, ErrorCode.CANCELLED, "the request was cancelled"))
                self.failed += 1
                return
            n = len(reply.token_ids)
            c = Completion(rid, reply.text, fin.finish_reason, len(ids), n, fin.usage.cached_tokens)
            self._write(result_record(req, cfg.model, c, int(time.time())), tokens=n)
            self.results += 1
            return


async def run_batch(cfg: BatchConfig, bus: Bus | None = None, tokenizer: Tokenizer | None = None) -> BatchSummary:
    """Run (or resume) a job. ``bus``: a started bus to use (else ``cfg.bus_url`` is connected)."""
    import bus as busmod

    tok = tokenizer if tokenizer is not None else await asyncio.to_thread(Tokenizer.for_model, cfg.model)
    own = bus is None
    b = busmod.connect(cfg.bus_url) if bus is None else bus
    if own:
        await b.start()
    try:
        return await BatchJob(cfg, b, tok).run()
    finally:
        if own:
            await b.stop()
