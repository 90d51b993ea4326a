"""``lockgate bench ...``: the benchmarks' subcommands, plugged into the CLI through the
``lockgate.commands`` entry point (pyproject.toml; ``lockgate.cli`` never imports the benchmarks, they
import its flag helpers). Nothing heavy is imported at module level."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lockgate.options import add_engine_args, env_default

# `lockgate bench accuracy`'s default modes (benchmarks/engine/accuracy.py, MODES): add a name when its mode merges
ACCURACY_MODES = "fp32,bf16,int8,q4_1,bf16-kv,w8a8,w8a8-bf16kv"


def _bench_engine(args: argparse.Namespace) -> int:
    from benchmarks.engine.bench import run

    return run(args)


def _bench_accuracy(args: argparse.Namespace) -> int:
    from benchmarks.engine.accuracy import run

    return run(args)


def _accuracy_modes(text: str) -> list[str]:
    from benchmarks.engine.accuracy import parse_modes

    try:
        return parse_modes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bench_spec(args: argparse.Namespace) -> int:
    from benchmarks.engine.spec import run

    return run(args)


def _bench_e2e(args: argparse.Namespace) -> int:
    from benchmarks.serving.e2e import run

    return run(args)


def _bench_decode(args: argparse.Namespace) -> int:
    from benchmarks.engine.decode_attention import run

    return run(args)


def _bench_moe(args: argparse.Namespace) -> int:
    from benchmarks.engine.moe import run

    return run(args)


def _bench_recovery(args: argparse.Namespace) -> int:
    from benchmarks.serving.recovery import run

    return run(args)


def _bench_edge_resume(args: argparse.Namespace) -> int:
    from benchmarks.serving.edge_resume import run

    return run(args)


def _bench_goodput(args: argparse.Namespace) -> int:
    from benchmarks.serving.goodput import run

    return run(args)


def _bench_priority(args: argparse.Namespace) -> int:
    from benchmarks.serving.priority import run

    return run(args)


def _bench_bus(args: argparse.Namespace) -> int:
    import asyncio

    from benchmarks.bus import bench_one, format_table
    from bus import BusError

    try:
        import uvloop  # what the services run on; the default loop costs ~20% more CPU per record

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    urls = ["memory://"] + ([args.bus] if not args.bus.startswith("memory:") else [])
    results = []
    try:
        for url in urls:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                results.append(runner.run(bench_one(url, args.rate, args.seconds, args.partitions, args.payload)))
    except BusError as exc:
        print(f"lockgate bench bus: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        print(f"lockgate bench bus --rate {args.rate} --seconds {args.seconds:g} --partitions {args.partitions} "
              f"--payload {args.payload}")
        print(format_table(results))
    return 0


def _bench_edge(args: argparse.Namespace) -> int:
    from benchmarks.edge.bench import run_bench

    return run_bench(args)


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

    from benchmarks.serving.loadgen import LengthMix, parse_rates
    from benchmarks.serving.serve import BenchConfig, bench, format_table
    from benchmarks.stats import parse_slo
    from lockgate.options import engine_config_from_args

    weights = tuple(float(x) for x in args.tier_mix.split(","))
    if len(weights) != 3:
        raise ValueError("--tier-mix needs three weights p0,p1,p2")
    keys = parse_keys(args.api_key)
    if args.url or args.openai_url:
        # Only tiers with a key can be sent; others are folded into the first available.
        weights = tuple(w if t in keys else 0.0 for t, w in enumerate(weights))
        if sum(weights) == 0:
            weights = tuple(1.0 if t in keys else 0.0 for t in range(3))
    mix = LengthMix(prompt_median=args.prompt_len, output_median=args.output_len, prompt_max=args.max_prompt_len,
                    output_max=args.max_output_len, prompt_min=min(4, args.max_prompt_len),
                    output_min=min(2, args.max_output_len), tier_weights=weights)
    target = "embedded" if args.embedded else "bus" if args.bus else "openai" if args.openai_url else "ws"
    cfg = BenchConfig(target=target, rates=tuple(parse_rates(args.rate)), num_prompts=args.num_prompts,
                      out_dir=args.out, url=args.url or args.openai_url, keys=keys, bus_url=args.bus, model=args.model,
                      arrivals=args.arrivals, burstiness=args.burstiness, seed=args.seed, slo=parse_slo(args.slo),
                      mix=mix, connections_per_tier=args.connections, max_concurrency=args.max_concurrency,
                      request_timeout_s=args.request_timeout, warmup=args.warmup, fake_worker=args.fake_worker, plots=not args.no_plots,
                      namespace=args.namespace, engine=engine_config_from_args(args) if args.embedded else None)
    result = asyncio.run(bench(cfg))
    print(format_table(result))
    print(f"wrote {args.out / 'results.json'}" + (f" and {len(result.get('plots', []))} PNGs" if cfg.plots else ""))
    return 0


def register(_sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("engine", help="engine throughput vs its own ablation, HF generate() and HF continuous "
                                        "batching, each engine in its own process")
    add_engine_args(b)  # every engine flag reaches lockgate (and its ablation) through engine_config_from_args
    b.add_argument("--num-requests", type=int, default=32,
                   help="requests drawn from the seeded generator (32 with seed 0: the anchors' workload)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--skip-hf", action="store_true", help="no HF rows")
    b.add_argument("--no-ablation", dest="ablation", action="store_false",
                   help="no lockgate --no-weight-prepack --no-cpu-kernels row (CPU only)")
    b.add_argument("--repeat", type=int, default=1,
                   help="rounds of every engine and the GEMM peak; each keeps its best (default 1)")
    b.add_argument("--json", action="store_true", help="print one JSON object (it has the table row too)")
    b.add_argument("--table-row", action="store_true", help="also print a Markdown table row for docs/benchmarks.md")
    b.set_defaults(func=_bench_engine)

    b = bench.add_parser("accuracy", help="each precision mode vs float32: greedy agreement, logits error, perplexity")
    add_engine_args(b)
    b.add_argument("--modes", type=_accuracy_modes, default=ACCURACY_MODES,
                   help="comma-separated modes, each measured against a float32 reference (benchmarks/engine/accuracy.py, "
                        "MODES: fp32, bf16, int8, q4_1, bf16-kv, w8a8, w8a8-bf16kv; a mode this build lacks is refused)")
    b.add_argument("--prompts", type=int, default=64, help="chat prompts (of the 64 in benchmarks/data/accuracy_prompts.json)")
    b.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    b.add_argument("--text-tokens", type=int, default=0, help="perplexity over the first N tokens of the text (0: all)")
    b.add_argument("--window", type=int, default=1024, help="perplexity window (tokens)")
    b.add_argument("--stride", type=int, default=1024,
                   help="tokens between window starts; each window scores only targets no earlier window scored")
    b.add_argument("--out", type=Path, default=None, help="also write the figures to this JSON file")
    b.set_defaults(func=_bench_accuracy)

    from benchmarks.engine.decode_attention import add_args as add_decode_args

    b = bench.add_parser("decode", help="paged decode attention kernel: split path vs per-sequence loop vs gather + "
                                        "SDPA, per layer, on serving-shaped batches")
    add_decode_args(b)
    b.set_defaults(func=_bench_decode)

    from benchmarks.engine.spec import add_args as add_spec_args

    b = bench.add_parser("spec", help="speculative decoding (n-gram or a draft model) vs plain decoding: TPOT, "
                                      "tok/s, acceptance, identical tokens, on a quoting, held-out or chat workload")
    add_spec_args(b)
    b.set_defaults(func=_bench_spec)

    from benchmarks.engine.moe import add_args as add_moe_args

    b = bench.add_parser("moe", help="grouped MoE layer vs transformers' MoE block and a dense MLP of equal active "
                                     "parameters; a small random MoE through the engine vs transformers generate")
    add_moe_args(b)
    b.set_defaults(func=_bench_moe)

    from benchmarks.serving.priority import add_args as add_priority_args

    b = bench.add_parser("e2e", help="engine workload through bus + worker vs the engine in-process")
    add_engine_args(b)
    b.add_argument("--bus", action="append", default=None,
                   help="bus URL(s) to measure (repeatable); default: memory:// and kafka://127.0.0.1:9092")
    b.add_argument("--num-requests", type=int, default=32)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--repeat", type=int, default=1,
                   help="rounds of every path; each path keeps its fastest run (noisy machines)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=_bench_e2e)

    from benchmarks.serving.recovery import add_args as add_recovery_args

    rc = bench.add_parser("recovery", help="kill -9 a worker mid-stream, repeatedly: time to the next token, re-run steps")
    add_recovery_args(rc)
    rc.set_defaults(func=_bench_recovery)

    from benchmarks.serving.edge_resume import add_args as add_edge_resume_args

    er = bench.add_parser("edge-resume", help="kill -9 an edge mid-stream, repeatedly: time to the client's next "
                                              "event on another edge; the shared state's cost per request")
    add_edge_resume_args(er)
    er.set_defaults(func=_bench_edge_resume)

    pr = bench.add_parser("priority", help="fifo vs strict vs aging intake under the same overload (PNG plot)")
    add_priority_args(pr)
    pr.set_defaults(func=_bench_priority)

    from benchmarks.serving.goodput import add_args as add_goodput_args

    gp = bench.add_parser("goodput", help="vllm bench serve --goodput ttft:500 tpot:50 against lockgate serve and "
                                          "vllm serve at rising rates, and a mixed-tier run (JSON, PNGs)")
    add_goodput_args(gp)
    gp.set_defaults(func=_bench_goodput)

    b = bench.add_parser("bus", help="produce->consume latency p50/p99 and records/s: memory bus vs --bus")
    b.add_argument("--bus", default=env_default("bus", "kafka://127.0.0.1:9092"),
                   help="bus compared with memory:// (env LOCKGATE_BUS); memory:// alone measures just that")
    b.add_argument("--rate", type=int, default=env_default("rate", 1000), help="records/s offered (env LOCKGATE_RATE)")
    b.add_argument("--seconds", type=float, default=env_default("seconds", 5.0), help="measured seconds (env LOCKGATE_SECONDS)")
    b.add_argument("--partitions", type=int, default=env_default("partitions", 6), help="partitions of the bench topic")
    b.add_argument("--payload", type=int, default=env_default("payload", 200), help="bytes per record")
    b.add_argument("--json", action="store_true", default=env_default("json", False), help="print JSON instead of a table")
    b.set_defaults(func=_bench_bus)

    b = bench.add_parser("edge", help="edge fan-out: connections held, tokens/s, added latency (fake worker)")
    b.add_argument("--connections", type=int, default=10_000, help="connections to open and hold")
    b.add_argument("--streams", type=int, default=1000, help="connections streaming at once")
    b.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    b.add_argument("--step-ms", type=float, default=20.0, help="fake worker step: one token per stream per step")
    b.add_argument("--client-procs", type=int, default=2, help="client processes")
    b.add_argument("--workers", type=int, default=1,
                   help="fake workers per edge process (at most the request topic's 6 partitions). 1: every "
                        "token of a step leaves in one burst; N: the streams split over N workers stepping "
                        "at evenly spread phases, as a fleet whose steps are not synchronised")
    b.add_argument("--client", choices=("raw", "websockets"), default="raw",
                   help="load generator: a lean frame parser (benchmarks/edge/client.py), or the websockets "
                        "library's client (~15 us/frame more CPU, taken from the edge on a small machine)")
    b.add_argument("--edge-procs", type=int, default=1,
                   help="edge processes sharing the port (SO_REUSEPORT), each with its own memory bus and fake worker")
    b.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip the kernel floor: the CPU of one bare loopback-TCP send per stream, "
                        "measured after the run (benchmarks/edge/floor.py)")
    b.add_argument("--json", default=None, help="also write the figures to this JSON file")
    b.set_defaults(func=_bench_edge)

    s = bench.add_parser("serve", help="serving benchmark (vLLM bench serve semantics) against an edge, the bus, or embedded")
    t = s.add_mutually_exclusive_group(required=True)
    t.add_argument("--url", help="edge WebSocket URL, e.g. ws://127.0.0.1:8765/ws")
    t.add_argument("--openai-url", help="any OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000/v1 "
                                        "(streaming chat completions; the model is the first of GET /models)")
    t.add_argument("--bus", help="drive the bus directly (no edge): bus URL; needs --model")
    t.add_argument("--embedded", action="store_true", help="memory bus + edge + worker in this process")
    s.add_argument("--api-key", action="append", default=[],
                   help="edge API key, optionally tagged with its tier: KEY or p0:KEY (repeatable; one per tier)")

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
