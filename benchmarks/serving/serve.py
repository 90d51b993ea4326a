"""``lockgate bench serve``: a serving benchmark with vLLM ``bench serve`` semantics.

For each offered rate: build the seeded workload (:mod:`benchmarks.serving.loadgen`: lognormal chat-like
lengths, tiers, Poisson or bursty arrivals), send each request at its arrival time (open loop; an
optional ``max_concurrency`` caps requests in flight), wait for all, and aggregate
(:mod:`benchmarks.stats`): TTFT, TPOT, ITL, E2E (mean, median, p99), request / output-token
throughput, goodput under the SLOs. Writes ``results.json`` and PNGs (:mod:`benchmarks.serving.plots`).

Targets (:mod:`benchmarks.serving.targets`): a running edge (``--url ws://...``, one API key per tier),
the bus directly (``--bus URL``: no edge in the path), or ``--embedded``: a memory bus, an
in-process edge on a free port with one unlimited key per tier, and an in-process worker
(:func:`embedded`). Every request is greedy with ``ignore_eos`` so it produces exactly its sampled
output length, as in vLLM's benchmark.

Cancellation: cancelling :func:`bench` cancels the requests in flight and stops the target and
the embedded platform (if any); nothing is written for an unfinished rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.serving.loadgen import LengthMix, SyntheticRequest, synthetic_text, workload
from benchmarks.serving.targets import BusTarget, OpenAITarget, Prompt, WsTarget
from benchmarks.stats import run_stats
from producers.timing import RequestTiming

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    target: str  # "ws" | "bus" | "embedded" | "openai"
    rates: tuple[float, ...]
    num_prompts: int
    out_dir: Path
    url: str | None = None
    keys: dict[int, str | None] = field(default_factory=lambda: {1: None})
    bus_url: str | None = None
    model: str | None = None  # model spec: tokenizer (bus/embedded) and the served name
    arrivals: str = "poisson"
    burstiness: float = 0.25
    seed: int = 0
    slo: dict[str, float] = field(default_factory=dict)
    mix: LengthMix = field(default_factory=LengthMix)
    connections_per_tier: int = 4
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    warmup: int = 1
    fake_worker: bool = False
    plots: bool = True
    namespace: str = "lockgate"  # topic namespace of --bus
    engine: object | None = None  # EngineConfig of the --embedded worker (None: defaults for model)

    def __post_init__(self) -> None:
        if self.target not in ("ws", "bus", "embedded", "openai"):
            raise ValueError(f"unknown target {self.target!r}")
        if self.target in ("ws", "openai") and not self.url:
            raise ValueError("give --url ws://host:port/ws, --bus URL or --embedded")
        if self.target == "bus" and not (self.bus_url and self.model):
            raise ValueError("--bus needs --model (the served model, for topics and the tokenizer)")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")


def build_prompts(reqs: list[SyntheticRequest], seed: int, tokenizer=None, vocab_floor: int = 3) -> list[Prompt]:
    """Text (for the edge) and exact token ids (for the bus) of each request. With a tokenizer the
    text is cut to ``prompt_len`` tokens (decode of the first ids), so lengths are close to the mix."""
    out = []
    for r in reqs:
        text = synthetic_text(r.prompt_len, seed * 1_000_003 + r.index)
        if tokenizer is not None:
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            while len(ids) < r.prompt_len:
                ids += ids or [vocab_floor]
            ids = ids[: r.prompt_len]
            text = tokenizer.decode(ids)
        else:
            ids = [vocab_floor + (hash((seed, r.index, i)) % 200) for i in range(r.prompt_len)]
        out.append(Prompt(r.index, r.tier, text, tuple(ids), r.output_len))
    return out


async def run_rate(target, reqs: list[SyntheticRequest], prompts: list[Prompt], timeout_s: float,
                   max_concurrency: int | None = None) -> tuple[list[RequestTiming], float]:
    """Send every request at its arrival time; returns the timings and the duration (first send
    to last reply)."""
    loop = asyncio.get_running_loop()
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(p: Prompt) -> RequestTiming:
        t_start = time.perf_counter()
        try:
            if sem is None:
                return await asyncio.wait_for(target.run_one(p), timeout_s)
            async with sem:
                return await asyncio.wait_for(target.run_one(p), timeout_s)
        except TimeoutError:
            return RequestTiming(t_start, (), time.perf_counter(), 0, len(p.token_ids), p.tier, False, "timeout")
        except Exception as exc:
            return RequestTiming(t_start, (), time.perf_counter(), 0, len(p.token_ids), p.tier, False,
                                 type(exc).__name__)

    tasks: list[asyncio.Task] = []
    start = loop.time()
    t0 = time.perf_counter()
    try:
        for r, p in zip(reqs, prompts):
            delay = start + r.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(one(p)))
        timings = list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    end = max((t.done_at for t in timings), default=t0)
    return timings, end - t0


def _request_row(t: RequestTiming) -> dict:
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 3)
    return {"tier": t.tier, "ok": t.ok, "error": t.error, "prompt_tokens": t.prompt_tokens,
            "output_tokens": t.output_tokens, "ttft_ms": ms(t.ttft), "tpot_ms": ms(t.tpot), "e2e_ms": ms(t.e2e),
            "itl_ms": [round(g * 1000, 3) for g in t.itls]}


def rate_result(rate: float, timings: list[RequestTiming], duration: float, slo: dict[str, float]) -> dict:
    tiers = sorted({t.tier for t in timings})
    return {"rate": rate, "stats": run_stats(timings, duration, slo).to_dict(),
            "by_tier": {f"p{tier}": run_stats([t for t in timings if t.tier == tier], duration, slo).to_dict()
                        for tier in tiers},
            "requests": [_request_row(t) for t in timings]}


@contextlib.asynccontextmanager
async def embedded(model_spec: str | None, fake_worker: bool = False,
                   engine_config=None) -> AsyncIterator[tuple[str, dict[int, str], object]]:
    """Memory bus + edge (free port, one unlimited key per tier) + worker, in this process.
    Yields (ws url, {tier: key}, tokenizer)."""
    from bus import MemoryBus
    from edge.config import EdgeConfig, KeyEntry, hash_key
    from edge.server import Edge
    from tokenization.model_store import model_name, resolve_model

    name, path = model_name(model_spec), str(resolve_model(model_spec))
    keys = {tier: f"lg-bench-p{tier}-{secrets.token_hex(8)}" for tier in (0, 1, 2)}
    entries = {hash_key(k): KeyEntry(hash_key(k), f"bench-p{t}", t, 0, 0, 0) for t, k in keys.items()}
    bus = MemoryBus()
    await bus.start()
    worker = None
    try:
        worker = await start_worker(bus, model_spec, name, fake_worker, engine_config)
        cfg = EdgeConfig(model=name, model_path=path, port=0, keys=entries, ping_interval_s=None,
                         slo_wait_s=(1e9, 1e9, 1e9), slo_ttft_ms=(1e12, 1e12, 1e12),  # the harness sheds nothing
                         max_streams_per_connection=100_000)
        async with Edge(cfg, bus) as edge:
            deadline = time.monotonic() + 60
            while not edge.readiness()[0]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"embedded edge not ready: {edge.readiness()[1]}")
                await asyncio.sleep(0.05)
            assert edge.encoder is not None  # the edge loads its tokenizer when it starts
            yield f"ws://127.0.0.1:{edge.port}/ws", keys, edge.encoder.tokenizer
    finally:
        if worker is not None:
            await worker.stop()
        await bus.stop()


async def start_worker(bus, model_spec: str | None, name: str, fake: bool, engine_config=None):
    """The in-process worker of ``--embedded``: the real engine worker (``engine_config``, default:
    an :class:`EngineConfig` for ``model_spec``), or the edge's FakeWorker (no model; for harness
    tests) when ``fake``. The caller stops it."""
    if fake:
        from devtools.fake_worker import FakeWorker

        fw = FakeWorker(bus, name)
        await fw.start()
        return fw
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from engine_workers.worker.actor import Worker, WorkerConfig

    engine = await asyncio.to_thread(Engine, engine_config or EngineConfig(model=model_spec))
    w = Worker(WorkerConfig(model=name), bus, engine)
    await w.start()
    return w


async def _measure(cfg: BenchConfig, target, tokenizer) -> dict:
    runs = []
    if cfg.warmup:
        warm = workload(cfg.warmup, math.inf, cfg.mix if cfg.warmup > 1 else cfg.mix.scaled(prompt_max=32, output_max=4),
                        cfg.seed + 99991)
        await run_rate(target, warm, build_prompts(warm, cfg.seed + 99991, tokenizer), cfg.request_timeout_s)
    for rate in cfg.rates:
        reqs = workload(cfg.num_prompts, rate, cfg.mix, cfg.seed, cfg.arrivals, cfg.burstiness)
        prompts = build_prompts(reqs, cfg.seed, tokenizer)
        log.info("bench serve: rate %g req/s, %d prompts", rate, len(reqs))
        timings, duration = await run_rate(target, reqs, prompts, cfg.request_timeout_s, cfg.max_concurrency)
        runs.append(rate_result(rate, timings, duration, cfg.slo))
    return {"config": _config_dict(cfg), "runs": runs}


def _config_dict(cfg: BenchConfig) -> dict:
    return {"target": cfg.target, "url": cfg.url, "bus": cfg.bus_url, "model": cfg.model, "rates": list(cfg.rates),
            "num_prompts": cfg.num_prompts, "arrivals": cfg.arrivals, "burstiness": cfg.burstiness, "seed": cfg.seed,
            "slo_s": cfg.slo, "mix": asdict(cfg.mix), "tiers": sorted(cfg.keys) if cfg.target in ("ws", "openai") else [0, 1, 2],
            "max_concurrency": cfg.max_concurrency, "fake_worker": cfg.fake_worker,
            "sampling": {"temperature": 0.0, "ignore_eos": True}}


async def bench(cfg: BenchConfig) -> dict:
    """Run every rate and write ``results.json`` (+ PNGs); returns the result dict."""
    if cfg.target == "embedded":
        async with embedded(cfg.model, cfg.fake_worker, cfg.engine) as (url, keys, tok):
            target = WsTarget(url, dict(keys), cfg.connections_per_tier)
            await target.start()
            try:
                result = await _measure(cfg, target, tok)
            finally:
                await target.stop()
    elif cfg.target == "openai":
        tok = None
        if cfg.model:
            from producers.prompting import Tokenizer

            tok = (await asyncio.to_thread(Tokenizer.for_model, cfg.model)).tokenizer
        oa = OpenAITarget(cfg.url or "", dict(cfg.keys), timeout_s=cfg.request_timeout_s)
        await oa.start()
        try:
            result = await _measure(cfg, oa, tok)
        finally:
            await oa.stop()
    elif cfg.target == "ws":
        tok = None
        if cfg.model:
            from producers.prompting import Tokenizer

            tok = (await asyncio.to_thread(Tokenizer.for_model, cfg.model)).tokenizer
        assert cfg.url is not None  # BenchConfig requires --url for this target
        target = WsTarget(cfg.url, dict(cfg.keys), cfg.connections_per_tier)
        await target.start()
        try:
            result = await _measure(cfg, target, tok)
        finally:
            await target.stop()
    else:
        import bus as busmod
        from producers.prompting import Tokenizer
        from tokenization.model_store import model_name

        assert cfg.model is not None and cfg.bus_url is not None  # BenchConfig requires both for --bus
        tok = (await asyncio.to_thread(Tokenizer.for_model, cfg.model)).tokenizer
        b = busmod.connect(cfg.bus_url)
        await b.start()
        from bus import TopicLayout

        bt = BusTarget(b, model_name(cfg.model), TopicLayout(namespace=cfg.namespace))
        try:
            await bt.start()
            result = await _measure(cfg, bt, tok)
        finally:
            await bt.stop()
            await b.stop()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "results.json").write_text(json.dumps(result, indent=1, default=_json_default))
    if cfg.plots:
        try:
            from benchmarks.serving.plots import write_plots

            result["plots"] = [p.name for p in write_plots(result, cfg.out_dir)]
        except ImportError as exc:  # matplotlib is the optional `plots` extra
            log.warning("no PNGs: %s (pip install 'lockgate[plots]')", exc)
    return result


def _json_default(o: object) -> object:
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def format_table(result: dict) -> str:
    """The human summary printed by the CLI (one block per rate)."""
    lines = []
    for run in result["runs"]:
        s = run["stats"]
        lines.append(f"rate {run['rate']:g} req/s: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.1f}s; "
                     f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} out tok/s"
                     + (f", goodput {s['goodput']:.2f} req/s" if s["goodput"] is not None else ""))
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            m = s[key]
            lines.append(f"  {key[:-3].upper():5s} mean {m['mean']} median {m['median']} p99 {m['p99']} ms")
    return "\n".join(lines)
