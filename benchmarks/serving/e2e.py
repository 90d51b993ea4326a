"""``lockgate bench e2e``: the engine workload through bus + worker vs the engine in-process.

Workload (seeded, like ``lockgate bench engine``): ``--num-requests`` requests (default 32), prompts
of 8-256 random token ids, 8-96 output tokens, greedy, ``ignore_eos``; all submitted at t0.

* in-process: one :class:`Engine`, every request added at t0, ``step()`` until done. TTFT =
  first token - t0 (the engine's own stamps).
* each ``--bus`` URL (default ``memory://`` and ``kafka://127.0.0.1:9092``): a :class:`Worker` on the
  same engine, a client publishing every request at t0 and reading the reply topic. TTFT = first
  chunk received by the client - t0; the run ends when the client has every ``Finished``.

Each ``--repeat`` round runs in-process first, then each bus; each path keeps its fastest of its
``--repeat`` runs (and lowest lone TTFT), the in-process baseline included: the same number of draws
for every path, so no best-of is lower by chance alone. Each bus path also gets its paired
ratios (every run against the in-process run that opened its round) and their median.
Where a bus path loses time: the engine counts the wall time inside its steps (``EngineStats.busy_s``),
so each path's wall splits into time in steps (on shared cores, the same steps run slower) and time
outside them (waiting for requests or replies); both are printed against in-process. And the CPU
each path used over its batch: the engine's threads (this process less its main thread: the torch
thread and its OpenMP team), the main thread (the event loop of worker and client on a bus path),
and a local broker's (``lockgate kafka start`` behind the first loopback ``kafka://`` URL; during an
in-process run that is the broker's idle use), each against in-process.
Prints throughput (generated tokens/s), the ratio to in-process (target >= 0.9), TTFT p50 under the
load, and the TTFT p50 of lone requests on an idle engine (sequential, 16-token prompts, 2 tokens)
with the part the bus path adds (target < 10 ms): under load, TTFT is mostly prefill queueing. Each run uses its own ``cache_salt`` so no run
reuses another's prefix cache, and a fresh topic namespace. One warm-up request per path first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import time
import uuid
from dataclasses import dataclass

from benchmarks.bus import local_broker_pids, process_cpu_s
from bus import (
    Finished,
    InferenceRequest,
    SamplingParams,
    TokenChunk,
    decode,
    encode,
    replies_of,
)

log = logging.getLogger(__name__)

DEFAULT_BUSES = ("memory://", "kafka://127.0.0.1:9092")  # the product defaults (bus/kafka/bus.py)


def workload(n: int, seed: int, vocab: int) -> list[tuple[tuple[int, ...], SamplingParams]]:
    rng = random.Random(seed)
    return [(tuple(rng.randrange(3, vocab) for _ in range(rng.randint(8, 256))),
             SamplingParams(max_tokens=rng.randint(8, 96), temperature=0.0, ignore_eos=True)) for _ in range(n)]


def p50(xs: list[float]) -> float:
    v = sorted(xs)
    return v[len(v) // 2] if v else float("nan")


LONE_RUNS = 9  # sequential single requests on an idle engine: the bus's own added latency
TARGET_RATIO = 0.9  # the targets for the bus path against in-process
TARGET_PATH_MS = 10.0


def lone_prompts(work) -> list[tuple[int, ...]]:
    return [work[i % len(work)][0][:16] for i in range(LONE_RUNS)]


@dataclass(frozen=True, slots=True)
class CpuMark:
    """CPU seconds so far, read at the start and at the end of a batch."""

    process_s: float  # every thread of this process
    thread_s: float  # the calling (main) thread
    broker_s: float | None  # the local broker; None when there is none to read


def cpu_mark(broker: list[int] | None) -> CpuMark:
    t = os.times()
    return CpuMark(t.user + t.system, time.thread_time(), process_cpu_s(broker) if broker else None)


def cpu_used(start: CpuMark, end: CpuMark) -> dict:
    """The batch's CPU by where it ran: ``engine_cpu_s`` (this process less its main thread),
    ``loop_cpu_s`` (the main thread), ``broker_cpu_s`` (``None`` without a readable local broker)."""
    loop = end.thread_s - start.thread_s
    broker = end.broker_s - start.broker_s if start.broker_s is not None and end.broker_s is not None else None
    return {"engine_cpu_s": end.process_s - start.process_s - loop, "loop_cpu_s": loop, "broker_cpu_s": broker}


def run_inprocess(engine, work, broker: list[int] | None = None) -> dict:
    salt = uuid.uuid4().hex
    lone, overhead = [], []
    for i, prompt in enumerate(lone_prompts(work)):
        t = time.monotonic()
        engine.add_request(f"l{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0), cache_salt=f"{salt}l{i}",
                           arrival_time=t)
        first, compute = None, 0.0
        while engine.has_unfinished():
            for out in engine.step():
                if out.token_ids and first is None:
                    first = time.monotonic()
                if out.finished and out.times is not None:
                    compute = out.times.first_token - out.times.first_scheduled
        assert first is not None  # the request ran to its end, so it produced a token
        lone.append(first - t)
        overhead.append(first - t - compute)
    engine.add_request("warm", work[0][0][:8], SamplingParams(max_tokens=2, temperature=0.0), cache_salt=salt + "w")
    while engine.has_unfinished():
        engine.step()
    t0, steps0, busy0, cpu0 = time.monotonic(), engine.stats.steps, engine.stats.busy_s, cpu_mark(broker)
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"b{i}", prompt, params, cache_salt=salt, arrival_time=t0)
    tokens, ttft = 0, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
            if out.finished and out.times and out.times.first_token is not None:
                ttft.append(out.times.first_token - t0)
    wall, cpu = time.monotonic() - t0, cpu_used(cpu0, cpu_mark(broker))
    return {"path": "in-process", "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "ttft_p50_s": p50(ttft), **cpu,
            "engine_steps": engine.stats.steps - steps0, "engine_busy_s": engine.stats.busy_s - busy0,
            "lone_ttft_p50_s": p50(lone), "lone_overhead_p50_s": p50(overhead)}


async def run_bus(engine, work, url: str, model: str, broker: list[int] | None = None) -> dict:
    from bus import BusError, TopicLayout, connect

    layout = TopicLayout(namespace=f"bench{uuid.uuid4().hex[:8]}", partitions=6)
    salt = uuid.uuid4().hex
    async with connect(url) as bus:
        reply = layout.reply_topic("bench")
        specs = layout.model_specs(model) + [layout.reply_spec("bench", 1)]
        await bus.ensure_topics(specs)
        try:
            return await _measure_bus(bus, engine, work, url, model, layout, reply, salt, broker)
        finally:
            # The namespace is this run's alone: a long-lived broker would otherwise keep ~10
            # topics per run for a week (repeated runs had left ~2,000 on the dev broker).
            try:
                await bus.delete_topics([s.name for s in specs])
            except BusError as exc:  # never hide the run's own error behind the clean-up's
                log.warning("could not delete this run's topics (%s): %s", layout.namespace, exc)


async def _measure_bus(bus, engine, work, url: str, model: str, layout, reply: str, salt: str,
                       broker: list[int] | None) -> dict:
    from engine_workers.worker.actor import Worker, WorkerConfig

    # The reply consumer is stopped before run_bus deletes the topics: a Kafka consumer still running
    # then asks for its topic's metadata, and a broker with auto-create on makes the topic again.
    async with Worker(WorkerConfig(model, layout=layout, heartbeat_s=0.5), bus, engine), \
            bus.consumer([reply], start_from="latest") as replies:

        async def send(rid: str, prompt, params, cache_salt: str = salt) -> None:
            r = InferenceRequest(rid, model, prompt, params, reply, tier=1, enqueued_at=time.time(),
                                 cache_salt=cache_salt)
            await bus.send(layout.request_topic(model, 1), encode(r), key=rid.encode())

        async def collect(ids: set[str], first: dict[str, float], timeout: float = 600,
                          finals: dict[str, Finished] | None = None) -> int:
            tokens, done = 0, set[str]()
            deadline = time.monotonic() + timeout
            while done != ids and time.monotonic() < deadline:
                for rec in await replies.getmany(timeout_ms=50):
                    for msg in replies_of(decode(rec.value)):
                        if isinstance(msg, TokenChunk) and msg.request_id in ids:
                            tokens += len(msg.token_ids)
                            first.setdefault(msg.request_id, time.monotonic())
                        elif isinstance(msg, Finished) and msg.request_id in ids:
                            done.add(msg.request_id)
                            if finals is not None:
                                finals[msg.request_id] = msg
            if done != ids:
                raise RuntimeError(f"{url}: {len(ids - done)} requests unfinished after {timeout}s")
            return tokens

        await send("warm", work[0][0][:8], SamplingParams(max_tokens=2, temperature=0.0))
        await collect({"warm"}, {})
        lone, overhead = [], []
        for i, prompt in enumerate(lone_prompts(work)):
            t = time.monotonic()
            got: dict[str, float] = {}
            fin: dict[str, Finished] = {}
            await send(f"l{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0), f"{salt}l{i}")
            await collect({f"l{i}"}, got, finals=fin)
            lone.append(got[f"l{i}"] - t)
            tm = fin[f"l{i}"].timings  # the worker's clock: arrival -> scheduled -> first token
            overhead.append(lone[-1] - (tm.ttft - tm.queue))
        ids = {f"b{i}" for i in range(len(work))}
        first: dict[str, float] = {}
        t0, cpu0, steps0, busy0 = time.monotonic(), cpu_mark(broker), engine.stats.steps, engine.stats.busy_s
        await asyncio.gather(*(send(f"b{i}", p, sp) for i, (p, sp) in enumerate(work)))
        tokens = await collect(ids, first)
        wall, cpu = time.monotonic() - t0, cpu_used(cpu0, cpu_mark(broker))
    # The Finished that ended `collect` left the engine after its step's busy time was counted.
    return {"path": url, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, **cpu,
            "engine_steps": engine.stats.steps - steps0, "engine_busy_s": engine.stats.busy_s - busy0,
            "ttft_p50_s": p50([t - t0 for t in first.values()]), "lone_ttft_p50_s": p50(lone),
            "lone_overhead_p50_s": p50(overhead)}


def _target_checks(r: dict) -> list[tuple[str, float, str, float, bool]]:
    """(name, measured, op, target, met) for a bus path's result: the ratio to in-process (best-of
    and paired median) >= TARGET_RATIO, the path's added lone latency < TARGET_PATH_MS."""
    ratio, paired, path = r["throughput_ratio"], r["paired_ratio_median"], r["added_overhead_p50_ms"]
    return [("throughput_ratio", ratio, ">=", TARGET_RATIO, ratio >= TARGET_RATIO),
            ("paired_ratio_median", paired, ">=", TARGET_RATIO, paired >= TARGET_RATIO),
            ("path_ms", path, "<", TARGET_PATH_MS, path < TARGET_PATH_MS)]


def run(args: argparse.Namespace) -> int:
    from engine_workers.engine.core import Engine
    from lockgate.options import engine_config_from_args

    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    engine = Engine(engine_config_from_args(args))
    work = workload(args.num_requests, args.seed, engine.loaded.spec.vocab_size)
    from lockgate.runtime import run_loop

    urls = args.bus or DEFAULT_BUSES
    # Rounds of in-process, then each bus (uvloop, as `lockgate worker` runs). Every path keeps its
    # fastest run, the baseline included, so a noisy neighbour during one run can flatter no path.
    # Every path gets the same number of runs: a best-of over more draws is lower by chance alone
    # (an extra closing in-process run, kept until 2026-12-04, leaned the ratio against the buses).
    inproc: list[dict] = []
    runs: dict[str, list[dict]] = {url: [] for url in urls}
    # One broker measured on every path: during the in-process runs its CPU is what it uses idle.
    broker = local_broker_pids(next((u for u in urls if u.startswith("kafka://")), ""))
    for _ in range(args.repeat):
        inproc.append(run_inprocess(engine, work, broker))
        for url in urls:
            runs[url].append(run_loop(run_bus(engine, work, url, args.model, broker)))

    def best(rs: list[dict], label: str) -> dict:
        return dict(min(rs, key=lambda r: r["wall_s"]), path=label,
                    lone_ttft_p50_s=min(r["lone_ttft_p50_s"] for r in rs),
                    lone_overhead_p50_s=min(r["lone_overhead_p50_s"] for r in rs),
                    runs_wall_s=[r["wall_s"] for r in rs])

    base = best(inproc, "in-process" if args.repeat == 1 else f"in-process (best of {args.repeat})")
    buses = [best(runs[url], url if args.repeat == 1 else f"{url} (best of {args.repeat})") for url in urls]
    for url, r in zip(urls, buses):
        # Each bus run against the in-process run that opened its round, minutes apart at most: a
        # ratio of neighbours, which a slow drift in the machine's load moves less than best-of.
        r["paired_ratios"] = [b["tok_s"] / a["tok_s"] for a, b in zip(inproc, runs[url])]
        r["paired_ratio_median"] = statistics.median(r["paired_ratios"])
    results = [base] + buses
    base["paired_ratios"], base["paired_ratio_median"] = [1.0] * args.repeat, 1.0
    for r in results:
        r["engine_wait_s"] = r["wall_s"] - r["engine_busy_s"]  # not inside a step: waiting for work or replies
        r["throughput_ratio"] = r["tok_s"] / base["tok_s"]
        r["added_ttft_p50_ms"] = (r["ttft_p50_s"] - base["ttft_p50_s"]) * 1000
        r["added_lone_ttft_p50_ms"] = (r["lone_ttft_p50_s"] - base["lone_ttft_p50_s"]) * 1000
        # What the path adds to a lone request's TTFT, net of that request's own prefill time: the
        # difference of two p50 TTFTs above mixes in the step-time noise of a shared CPU.
        r["added_overhead_p50_ms"] = (r["lone_overhead_p50_s"] - base["lone_overhead_p50_s"]) * 1000
    for r in buses:
        r["targets_met"] = {name: met for name, _, _, _, met in _target_checks(r)}
    if args.json:
        print(json.dumps({"num_requests": len(work), "results": results}))
        return 0
    print(f"workload: {len(work)} requests, prompts 8-256, outputs 8-96 (greedy, ignore_eos), seed {args.seed}; "
          f"model {args.model}, device {engine.device}")
    print(f"{'path':40} {'tokens':>7} {'wall s':>7} {'tok/s':>8} {'ratio':>6} {'TTFT p50 ms':>12} {'added':>8} "
          f"{'lone TTFT ms':>12} {'added':>7} {'path ms':>8} {'added':>7}")
    for r in results:
        print(f"{r['path'][:40]:40} {r['tokens']:7d} {r['wall_s']:7.2f} {r['tok_s']:8.1f} {r['throughput_ratio']:6.3f} "
              f"{r['ttft_p50_s'] * 1000:12.1f} {r['added_ttft_p50_ms']:8.1f} {r['lone_ttft_p50_s'] * 1000:12.1f} "
              f"{r['added_lone_ttft_p50_ms']:7.1f} {r['lone_overhead_p50_s'] * 1000:8.2f} {r['added_overhead_p50_ms']:7.2f}")
    for r in results:
        print(f"runs of {r['path']}: " + ", ".join(f"{w:.2f} s" for w in r["runs_wall_s"]))
    for r in results:
        print(f"engine time of {r['path']} (its fastest run): {r['engine_busy_s']:.2f} s in {r['engine_steps']} steps, "
              f"{r['engine_wait_s']:.2f} s outside them (wall - steps: waiting for requests, replies, the torch thread)")
    for r in buses:
        print(f"{r['path']} against in-process: in steps {r['engine_busy_s'] - base['engine_busy_s']:+.2f} s (the same "
              f"steps, on cores the path shares), outside steps {r['engine_wait_s'] - base['engine_wait_s']:+.2f} s "
              "(waiting on the path)")
    for r in results:
        print(f"CPU of {r['path']} (its fastest run): engine threads {r['engine_cpu_s']:.2f} s, main thread "
              f"{r['loop_cpu_s']:.2f} s" + (f", broker {r['broker_cpu_s']:.2f} s" if r["broker_cpu_s"] is not None else ""))
    for r in buses:
        broker_delta = (f", broker {r['broker_cpu_s'] - base['broker_cpu_s']:+.2f} s"
                        if r["broker_cpu_s"] is not None and base["broker_cpu_s"] is not None else "")
        print(f"{r['path']} against in-process, CPU: engine threads {r['engine_cpu_s'] - base['engine_cpu_s']:+.2f} s, "
              f"main thread {r['loop_cpu_s'] - base['loop_cpu_s']:+.2f} s{broker_delta}")
    for r in buses:
        print(f"paired ratios of {r['path']} (each run / the in-process run of its round): "
              + ", ".join(f"{x:.3f}" for x in r["paired_ratios"]) + f"; median {r['paired_ratio_median']:.3f}")
    for r in buses:
        print(f"targets of {r['path']}: " + ", ".join(
            f"{name} {value:.3f} {op} {goal:g}: {'met' if met else 'MISSED'}" for name, value, op, goal, met in
            _target_checks(r)))
    print(f"TTFT = under the full load (all requests at t0); lone TTFT = p50 of {LONE_RUNS} sequential single "
          "requests on an idle engine; path ms = lone TTFT minus that request's own scheduled->first-token time "
          "(p50): what the bus path adds, free of step-time noise")
    return 0
