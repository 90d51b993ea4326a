"""``lockgate replay``: re-publish recorded requests from the priority topics and compare.

1. Read the window: one group-less consumer per run on the given priority topics, starting at
   ``since`` (Kafka ``offsets_for_times``); records after ``until`` are ignored. Reading stops
   when every assigned partition has passed ``until`` or nothing arrived for ``idle_s``.
2. Re-publish each :class:`InferenceRequest`, in record-timestamp order, keeping the recorded
   inter-arrival times divided by ``speed``, to the same topic on the target bus, with request id
   ``<orig>.replay-<run>`` and a fresh reply topic ``reply.replay-<run>``. Earlier replays in the
   window (ids containing ``.replay-``) are skipped unless ``include_replays``.
3. Collect the replies (:class:`~producers.collector.ReplyCollector`) and report TTFT/TPOT/E2E
   (client-observed, from publish to reply) and, for greedy requests, whether the output tokens
   equal the originally recorded reply (read from the original ``reply_to`` topic from ``since``;
   ``unavailable`` when it is gone, incomplete or aborted).

Cancellation: cancelling :func:`run_replay` cancels the pending waits and stops its consumers;
requests already published are not cancelled (they are replays; their replies are dropped).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field, replace

from bus import Bus, DecodeError, InferenceRequest, TopicLayout, TopicSpec, decode, encode, read_time_window
from producers.collector import Reply, ReplyCollector
from producers.timing import RequestTiming, Summary

log = logging.getLogger(__name__)

REPLAY_MARK = ".replay-"


def replay_id(original: str, run: str) -> str:
    return f"{original}{REPLAY_MARK}{run}"


@dataclass(frozen=True, slots=True)
class Recorded:
    request: InferenceRequest
    topic: str
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    bus_url: str
    topics: tuple[str, ...]
    since_ms: int
    until_ms: int
    speed: float = 1.0
    target_bus_url: str | None = None
    layout: TopicLayout = field(default_factory=TopicLayout)
    idle_s: float = 2.0
    max_requests: int = 100_000
    request_timeout_s: float = 300.0
    originals_timeout_s: float = 10.0
    include_replays: bool = False
    run_id: str | None = None

    def __post_init__(self) -> None:
        if not self.topics:
            raise ValueError("give at least one --topic")
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0, got {self.speed}")
        if self.until_ms < self.since_ms:
            raise ValueError("until is before since")


async def read_window(bus: Bus, topics: tuple[str, ...], since_ms: int, until_ms: int, *, idle_s: float = 2.0,
                      max_records: int = 100_000) -> tuple[list[Recorded], int]:
    """Recorded requests with since <= timestamp <= until, in timestamp order, and the number of
    records skipped as not decodable / not requests (of at most ``max_records`` read;
    :func:`bus.window.read_time_window`)."""
    out: list[Recorded] = []
    skipped = 0
    for rec in await read_time_window(bus, topics, since_ms, until_ms, limit=max_records, idle_s=idle_s):
        try:
            msg = decode(rec.value)
        except DecodeError:
            skipped += 1
            continue
        if not isinstance(msg, InferenceRequest):
            skipped += 1
            continue
        out.append(Recorded(msg, rec.topic, rec.timestamp_ms))
    out.sort(key=lambda r: (r.timestamp_ms, r.request.request_id))
    return out, skipped


async def read_originals(bus: Bus, recorded: list[Recorded], since_ms: int, timeout_s: float) -> dict[str, Reply]:
    """The recorded replies of ``recorded`` (complete ones only), read from their reply topics."""
    by_topic: dict[str, list[str]] = {}
    for r in recorded:
        by_topic.setdefault(r.request.reply_to, []).append(r.request.request_id)
    found: dict[str, Reply] = {}
    for topic, ids in by_topic.items():
        try:
            await bus.partitions_for(topic)
        except Exception:  # topic gone (retention, deleted): unavailable
            continue
        col = ReplyCollector(bus, topic, start_from=max(0, since_ms - 1000))
        futs = {rid: col.expect(rid) for rid in ids}
        await col.start()
        try:
            await asyncio.wait(list(futs.values()), timeout=timeout_s)
        finally:
            for rid, f in futs.items():
                if f.done() and not f.cancelled():
                    found[rid] = f.result()
            await col.stop()
    return found


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    original_id: str
    request_id: str
    tier: int
    greedy: bool
    timing: RequestTiming
    token_ids: tuple[int, ...]
    match: str | None = None  # "match" | "mismatch" | "unavailable" for greedy requests


async def _replay_one(bus: Bus, col: ReplyCollector, rec: Recorded, req: InferenceRequest, timeout_s: float) -> ReplayOutcome:
    fut = col.expect(req.request_id)
    sent = col.clock()
    await bus.send(rec.topic, encode(req), key=req.request_id.encode())
    try:
        reply = await asyncio.wait_for(fut, timeout_s)
    except TimeoutError:
        col.forget(req.request_id)
        t = RequestTiming(sent, (), col.clock(), 0, len(req.prompt_token_ids), req.tier, False, "timeout")
        return ReplayOutcome(rec.request.request_id, req.request_id, req.tier, req.sampling.greedy, t, ())
    ok = reply.ok and reply.finished is not None and reply.finished.finish_reason != "abort"
    err = None if ok else (reply.error.code if reply.error else "abort")
    t = RequestTiming(sent, reply.chunk_times, reply.done_at, len(reply.token_ids), len(req.prompt_token_ids),
                      req.tier, ok, err)
    return ReplayOutcome(rec.request.request_id, req.request_id, req.tier, req.sampling.greedy, t, reply.token_ids)


def compare(outcomes: list[ReplayOutcome], originals: dict[str, Reply]) -> list[ReplayOutcome]:
    out = []
    for o in outcomes:
        if not o.greedy:
            out.append(o)
            continue
        orig = originals.get(o.original_id)
        if orig is None or not orig.ok or orig.finished is None or orig.finished.finish_reason == "abort" or not o.timing.ok:
            verdict = "unavailable"
        else:
            verdict = "match" if orig.token_ids == o.token_ids else "mismatch"
        out.append(replace(o, match=verdict))
    return out


def report(cfg: ReplayConfig, run: str, recorded: int, skipped_replays: int, outcomes: list[ReplayOutcome],
           wall_s: float) -> dict:
    def lat(ts: list[RequestTiming]) -> dict:
        ok = [t for t in ts if t.ok]
        return {"ttft_ms": Summary.of(t.ttft for t in ok if t.ttft is not None).scaled(1000).to_dict(),
                "tpot_ms": Summary.of(x for t in ok if (x := t.tpot) is not None).scaled(1000).to_dict(),
                "e2e_ms": Summary.of(t.e2e for t in ok).scaled(1000).to_dict()}

    timings = [o.timing for o in outcomes]
    errors: dict[str, int] = {}
    for t in timings:
        if not t.ok:
            errors[t.error or "unknown"] = errors.get(t.error or "unknown", 0) + 1
    verdicts = [o.match for o in outcomes if o.greedy]
    return {
        "run_id": run, "topics": list(cfg.topics), "since_ms": cfg.since_ms, "until_ms": cfg.until_ms,
        "speed": cfg.speed, "recorded": recorded, "skipped_replays": skipped_replays, "replayed": len(outcomes),
        "completed": sum(t.ok for t in timings), "failed": sum(not t.ok for t in timings), "errors": errors,
        "wall_s": round(wall_s, 3), "latency": lat(timings),
        "latency_by_tier": {f"p{tier}": lat([t for t in timings if t.tier == tier])
                            for tier in sorted({t.tier for t in timings})},
        "greedy": {"requests": len(verdicts), "match": verdicts.count("match"),
                   "mismatch": verdicts.count("mismatch"), "unavailable": verdicts.count("unavailable"),
                   "mismatched_ids": [o.original_id for o in outcomes if o.match == "mismatch"][:50]},
        "requests": [{"original_id": o.original_id, "request_id": o.request_id, "tier": o.tier, "ok": o.timing.ok,
                      "error": o.timing.error, "output_tokens": o.timing.output_tokens,
                      "ttft_ms": None if o.timing.ttft is None else round(o.timing.ttft * 1000, 3),
                      "e2e_ms": round(o.timing.e2e * 1000, 3), "match": o.match} for o in outcomes],
    }


async def run_replay(cfg: ReplayConfig, source: Bus | None = None, target: Bus | None = None) -> dict:
    """Run a replay and return the report (see :func:`report`). Buses given are used as they are
    (started, left running); otherwise they are connected from the config and stopped at the end."""
    import bus as busmod

    owned: list[Bus] = []
    if source is None:
        source = busmod.connect(cfg.bus_url)
        await source.start()
        owned.append(source)
    if target is None:
        if cfg.target_bus_url and cfg.target_bus_url != cfg.bus_url:
            target = busmod.connect(cfg.target_bus_url)
            await target.start()
            owned.append(target)
        else:
            target = source
    try:
        return await _run(cfg, source, target)
    finally:
        for b in owned:
            await b.stop()


async def _run(cfg: ReplayConfig, source: Bus, target: Bus) -> dict:
    run = cfg.run_id or secrets.token_hex(4)
    t0 = time.monotonic()
    recorded, _ = await read_window(source, cfg.topics, cfg.since_ms, cfg.until_ms, idle_s=cfg.idle_s,
                                    max_records=cfg.max_requests)
    todo = [r for r in recorded if cfg.include_replays or REPLAY_MARK not in r.request.request_id]
    skipped = len(recorded) - len(todo)
    originals_task = asyncio.create_task(
        read_originals(source, [r for r in todo if r.request.sampling.greedy], cfg.since_ms, cfg.originals_timeout_s))
    reply_owner = f"replay-{run}"
    lay = cfg.layout
    specs = [lay.reply_spec(reply_owner)] + [TopicSpec(t, lay.partitions, lay.replication, lay.retention_ms)
                                               for t in sorted({r.topic for r in todo})]
    await target.ensure_topics(specs)
    col = ReplyCollector(target, lay.reply_topic(reply_owner), start_from="latest")
    await col.start()
    tasks: list[asyncio.Task] = []
    loop = asyncio.get_running_loop()
    try:
        start = loop.time()
        base = todo[0].timestamp_ms if todo else 0
        for rec in todo:
            delay = start + (rec.timestamp_ms - base) / 1000.0 / cfg.speed - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            o = rec.request
            wall = time.time()
            deadline = None if o.deadline is None else wall + max(1.0, o.deadline - o.enqueued_at)
            # A request recorded before seeds were always set gets one now, like any new request.
            req = replace(o, request_id=replay_id(o.request_id, run), reply_to=col.topic, enqueued_at=wall,
                          deadline=deadline, attempt=0, sampling=o.sampling.seeded())
            tasks.append(loop.create_task(_replay_one(target, col, rec, req, cfg.request_timeout_s)))
        outcomes = list(await asyncio.gather(*tasks))
        originals = await originals_task
    finally:
        for t in [*tasks, originals_task]:
            t.cancel()
        await asyncio.gather(*tasks, originals_task, return_exceptions=True)
        await col.retire()  # this run's reply topic, unless a request may still answer
    return report(cfg, run, len(recorded), skipped, compare(outcomes, originals), time.monotonic() - t0)
