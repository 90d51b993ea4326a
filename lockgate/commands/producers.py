"""CLI of the producers: ``lockgate batch run``, ``lockgate replay`` (``lockgate bench serve`` is :mod:`benchmarks.cli`'s).

Nothing heavy at import: transformers and aiokafka load inside the commands.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lockgate.options import env_default


def register(sub: argparse._SubParsersAction, _bench: argparse._SubParsersAction) -> None:
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



def _batch_run(args: argparse.Namespace) -> int:
    import asyncio

    from bus import TopicLayout
    from producers.batch import BatchConfig, run_batch
    from producers.prompting import Tokenizer
    from tokenization.model_store import model_name

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

    from bus import TopicLayout, parse_time_ms
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
