"""CLI of the producers: ``lockgate batch run``, ``lockgate replay``, ``lockgate bench serve``.

Nothing heavy at import: transformers, aiokafka, websockets and matplotlib load inside the commands.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine_workers.cli import env_default


def register(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    b = sub.add_parser("batch", help="OpenAI Batch API jobs over the bus")
    bs = b.add_subparsers(dest="batch_command", metavar="ACTION")
    r = bs.add_parser("run", help="run (or resume) a batch job: input JSONL -> output JSONL")
    r.add_argument("input", type=Path, help="OpenAI batch input (custom_id, method, url, body per line)")
    r.add_argument("--out", type=Path, required=True, help="output JSONL; rerunning resumes it")
    r.add_argument("--bus", default=env_default("bus", "kafka://127.0.0.1:9092"), help="bus URL [LOCKGATE_BUS]")
    r.add_argument("--model", default=env_default("model", "default"), help="served model (folder, hub id or default) [LOCKGATE_MODEL]")
    r.add_argument("--max-in-flight", type=int, default=env_default("max-in-flight", 64), help="requests on the bus at once")
    r.add_argument("--job-id", default=env_default("job-id", None), help="job id (reply topic job-<id>); default: from the output path")
    r.add_argument("--request-timeout", type=float, default=env_default("request-timeout", 600.0), help="seconds per request")
    r.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a line gives none")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    r.add_argument("--namespace", default=env_default("namespace", "lockgate"), help="topic namespace [LOCKGATE_NAMESPACE]")
    r.set_defaults(func=_batch_run)

    p = sub.add_parser("replay", help="re-publish recorded requests from the priority topics; latency + greedy match report")
    p.add_argument("--bus", default=env_default("bus", "kafka://127.0.0.1:9092"), help="bus holding the recorded topics")
    p.add_argument("--topic", action="append", required=True, help="priority topic to read (repeatable)")
    p.add_argument("--since", required=True, help="window start: ms since epoch, ISO 8601 (naive = UTC), now, or 15m / 2h / 1d ago")
    p.add_argument("--until", default="now", help="window end (same forms; default now)")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed: inter-arrival gaps are divided by this")
    p.add_argument("--target-bus", default=None, help="bus to re-publish to (default: --bus)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here (else stdout)")
    p.add_argument("--include-replays", action="store_true", help="also replay earlier replays found in the window")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--idle", type=float, default=2.0, help="stop reading the window after this many idle seconds")
    p.add_argument("--namespace", default=env_default("namespace", "lockgate"), help="topic namespace [LOCKGATE_NAMESPACE]")
    p.set_defaults(func=_replay)

    s = bench.add_parser("serve", help="serving benchmark (vLLM bench serve semantics) against an edge, the bus, or embedded")
    t = s.add_mutually_exclusive_group(required=True)
    t.add_argument("--url", help="edge WebSocket URL, e.g. ws://127.0.0.1:8765/ws")
    t.add_argument("--bus", help="drive the bus directly (no edge): bus URL; needs --model")
    t.add_argument("--embedded", action="store_true", help="memory bus + edge + worker in this process")
    s.add_argument("--api-key", action="append", default=[],
                   help="edge API key, optionally tagged with its tier: KEY or p0:KEY (repeatable; one per tier)")
    from engine_workers.commands import add_engine_args

    add_engine_args(s)  # --model (tokenizer; served model of --bus/--embedded) + the embedded worker's engine
    s.add_argument("--fake-worker", action="store_true", help="--embedded with the edge's fake worker (no model; harness check)")
    s.add_argument("--rate", default="1,2,4", help="offered rates in req/s, comma separated (inf = all at once)")
    s.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    s.add_argument("--arrivals", choices=("poisson", "bursty"), default="poisson")
    s.add_argument("--burstiness", type=float, default=0.25, help="gamma shape for --arrivals bursty (<1 is burstier)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--slo", default="ttft=500ms,tpot=50ms", help="goodput SLOs, e.g. ttft=500ms,tpot=50ms[,e2e=10s]")
    s.add_argument("--prompt-len", type=float, default=120, help="median prompt length (tokens)")
    s.add_argument("--output-len", type=float, default=60, help="median output length (tokens)")
    s.add_argument("--max-prompt-len", type=int, default=1024)
    s.add_argument("--max-output-len", type=int, default=512)
    s.add_argument("--tier-mix", default="0.2,0.6,0.2", help="share of requests per tier p0,p1,p2")
    s.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    s.add_argument("--connections", type=int, default=4, help="WebSocket connections per tier")
    s.add_argument("--request-timeout", type=float, default=600.0)
    s.add_argument("--warmup", type=int, default=1,
                   help="unmeasured requests sent at once before the first rate (1: one short request; >1: the real mix)")
    s.add_argument("--out", type=Path, default=Path("bench-serve"), help="output folder (results.json, PNGs)")
    s.add_argument("--no-plots", action="store_true")
    s.add_argument("--namespace", default=env_default("namespace", "lockgate"), help="topic namespace [LOCKGATE_NAMESPACE]")
    s.set_defaults(func=_bench_serve)


def _batch_run(args: argparse.Namespace) -> int:
    import asyncio

    from bus.topics import TopicLayout
    from engine_workers.model_store import model_name
    from producers.batch import BatchConfig, run_batch
    from producers.prompting import Tokenizer

    if not args.input.is_file():
        raise ValueError(f"input file {args.input} does not exist")
    cfg = BatchConfig(input=args.input, output=args.out, bus_url=args.bus, model=model_name(args.model),
                      max_in_flight=args.max_in_flight, job_id=args.job_id, request_timeout_s=args.request_timeout,
                      default_max_tokens=args.default_max_tokens, progress=not args.no_progress,
                      layout=TopicLayout(namespace=args.namespace))
    tok = Tokenizer.for_model(args.model)
    summary = asyncio.run(run_batch(cfg, tokenizer=tok))
    print(json.dumps({"job_id": cfg.job, "output": str(args.out), "total": summary.total, "skipped": summary.skipped,
                      "results": summary.results, "failed": summary.failed, "bad_lines": summary.bad_lines,
                      "output_tokens": summary.output_tokens, "seconds": round(summary.seconds, 2)}))
    return 0


def _replay(args: argparse.Namespace) -> int:
    import asyncio

    from bus.topics import TopicLayout
    from bus.window import parse_time_ms
    from producers.replay import ReplayConfig, run_replay

    cfg = ReplayConfig(bus_url=args.bus, topics=tuple(args.topic), since_ms=parse_time_ms(args.since),
                       until_ms=parse_time_ms(args.until), speed=args.speed, target_bus_url=args.target_bus,
                       idle_s=args.idle, request_timeout_s=args.request_timeout, include_replays=args.include_replays,
                       layout=TopicLayout(namespace=args.namespace))
    rep = asyncio.run(run_replay(cfg))
    text = json.dumps(rep, indent=1)
    if args.out:
        args.out.write_text(text)
        g = rep["greedy"]
        print(f"replayed {rep['replayed']} ({rep['completed']} ok, {rep['failed']} failed); greedy: {g['match']} match, "
              f"{g['mismatch']} mismatch, {g['unavailable']} unavailable; report in {args.out}", file=sys.stderr)
    else:
        print(text)
    return 0


def parse_keys(values: list[str]) -> dict[int, str | None]:
    """``["p0:KEY0", "KEY1"]`` -> {0: "KEY0", 1: "KEY1"}; untagged keys count as p1, then p2, p0."""
    keys: dict[int, str | None] = {}
    untagged = []
    for v in values:
        tier, sep, key = v.partition(":")
        if sep and tier.lower() in ("p0", "p1", "p2"):
            keys[int(tier[1])] = key
        else:
            untagged.append(v)
    for v in untagged:
        free = [t for t in (1, 2, 0) if t not in keys]
        if not free:
            raise ValueError("at most one --api-key per tier")
        keys[free[0]] = v
    return keys or {1: None}


def _bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from engine_workers.commands import engine_config_from_args
    from producers.bench_serve import BenchConfig, bench, format_table
    from producers.loadgen import LengthMix, parse_rates
    from producers.stats import parse_slo

    weights = tuple(float(x) for x in args.tier_mix.split(","))
    if len(weights) != 3:
        raise ValueError("--tier-mix needs three weights p0,p1,p2")
    keys = parse_keys(args.api_key)
    if args.url:
        # Only tiers with a key can be sent; others are folded into the first available.
        weights = tuple(w if t in keys else 0.0 for t, w in enumerate(weights))
        if sum(weights) == 0:
            weights = tuple(1.0 if t in keys else 0.0 for t in range(3))
    mix = LengthMix(prompt_median=args.prompt_len, output_median=args.output_len, prompt_max=args.max_prompt_len,
                    output_max=args.max_output_len, prompt_min=min(4, args.max_prompt_len),
                    output_min=min(2, args.max_output_len), tier_weights=weights)
    target = "embedded" if args.embedded else ("bus" if args.bus else "ws")
    cfg = BenchConfig(target=target, rates=tuple(parse_rates(args.rate)), num_prompts=args.num_prompts,
                      out_dir=args.out, url=args.url, keys=keys, bus_url=args.bus, model=args.model,
                      arrivals=args.arrivals, burstiness=args.burstiness, seed=args.seed, slo=parse_slo(args.slo),
                      mix=mix, connections_per_tier=args.connections, max_concurrency=args.max_concurrency,
                      request_timeout_s=args.request_timeout, warmup=args.warmup, fake_worker=args.fake_worker, plots=not args.no_plots,
                      namespace=args.namespace, engine=engine_config_from_args(args) if args.embedded else None)
    result = asyncio.run(bench(cfg))
    print(format_table(result))
    print(f"wrote {args.out / 'results.json'}" + (f" and {len(result.get('plots', []))} PNGs" if cfg.plots else ""))
    return 0
