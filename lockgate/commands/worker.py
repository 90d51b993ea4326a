"""CLI of the worker: ``lockgate worker`` (``lockgate bench e2e`` and ``bench priority`` are
:mod:`benchmarks.cli`'s).

Listed in ``lockgate.cli.COMMAND_MODULES``; nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from lockgate.options import add_engine_args, engine_config_from_args, env_default
from lockgate.runtime import freeze_heap, run_loop

log = logging.getLogger(__name__)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--bus", default=env_default("bus", "kafka://127.0.0.1:9092"),
                   help="bus URL: kafka://host:port[?session_timeout_ms=..] or memory://name [LOCKGATE_BUS]")
    g.add_argument("--served-model-name", default=env_default("served-model-name", None),
                   help="model name on the bus (topics, request.model); default: --model [LOCKGATE_SERVED_MODEL_NAME]")
    g.add_argument("--namespace", default=env_default("namespace", "lockgate"), help="topic namespace [LOCKGATE_NAMESPACE]")
    g.add_argument("--partitions", type=int, default=env_default("partitions", 6),
                   help="partitions per priority topic when creating them [LOCKGATE_PARTITIONS]")
    g.add_argument("--worker-id", default=env_default("worker-id", None), help="default: worker-<random> [LOCKGATE_WORKER_ID]")
    g.add_argument("--intake-mode", choices=("aging", "strict", "fifo"), default=env_default("intake-mode", "aging"),
                   help="admission order [LOCKGATE_INTAKE_MODE]")
    g.add_argument("--aging-period", type=float, default=env_default("aging-period", 2.0),
                   help="seconds of waiting worth one tier step (aging mode) [LOCKGATE_AGING_PERIOD]")
    g.add_argument("--fair-share", action=argparse.BooleanOptionalAction, default=env_default("fair-share", True),
                   help="within a tier, share admissions across tenants by weighted fair queueing over tokens; "
                        "--no-fair-share: FIFO per tier [LOCKGATE_FAIR_SHARE]")
    g.add_argument("--age-credit-periods", type=float, default=env_default("age-credit-periods", None),
                   help="count at most this many aging periods of a record's time on the topic (protects fresh "
                        "p0 from an old p2 backlog; unset = all of it, the p2 starvation bound) [LOCKGATE_AGE_CREDIT_PERIODS]")
    g.add_argument("--prefetch-per-tier", type=int, default=env_default("prefetch-per-tier", 4),
                   help="requests held per tier beyond free sequence slots [LOCKGATE_PREFETCH_PER_TIER]")
    g.add_argument("--drain-grace", type=float, default=env_default("drain-grace", 30.0),
                   help="SIGTERM: seconds to let running requests finish [LOCKGATE_DRAIN_GRACE]")
    g.add_argument("--commit-interval", type=float, default=env_default("commit-interval", 1.0),
                   help="commit finished work at most every N s; drain, rebalance and stop commit at once "
                        "[LOCKGATE_COMMIT_INTERVAL]")
    g.add_argument("--send-failure-reruns", type=int, default=env_default("send-failure-reruns", 2),
                   help="a request whose replies could not be sent runs again this many times, then is answered "
                        "with an error [LOCKGATE_SEND_FAILURE_RERUNS]")
    g.add_argument("--max-reply-record-bytes", type=int, default=env_default("max-reply-record-bytes", 1 << 20),
                   help="split a step's coalesced replies into records of at most this size; keep it at or under "
                        "the producer's max_request_size [LOCKGATE_MAX_REPLY_RECORD_BYTES]")
    g.add_argument("--heartbeat", type=float, default=env_default("heartbeat", 0.5), help="status period, s [LOCKGATE_HEARTBEAT]")
    g.add_argument("--metrics-host", default=env_default("metrics-host", "127.0.0.1"), help="[LOCKGATE_METRICS_HOST]")
    g.add_argument("--metrics-port", type=int, default=env_default("metrics-port", None),
                   help="/healthz /readyz /metrics port (0 = any; unset = off) [LOCKGATE_METRICS_PORT]")


def worker_config_from_args(args: argparse.Namespace):
    from bus import TopicLayout
    from engine_workers.worker.config import WorkerConfig
    from tokenization.model_store import model_name

    kw = {"worker_id": args.worker_id} if args.worker_id else {}
    return WorkerConfig(
        model=args.served_model_name or model_name(args.model),  # same name the edge uses
        layout=TopicLayout(namespace=args.namespace, partitions=args.partitions),
        intake_mode=args.intake_mode, aging_period_s=args.aging_period, age_credit_periods=args.age_credit_periods, fair_share=args.fair_share,
        prefetch_per_tier=args.prefetch_per_tier,
        heartbeat_s=args.heartbeat, drain_grace_s=args.drain_grace, commit_interval_s=args.commit_interval,
        send_failure_reruns=args.send_failure_reruns, max_reply_record_bytes=args.max_reply_record_bytes,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port, **kw,
    )


async def _serve(args: argparse.Namespace) -> int:
    from bus import connect
    from engine_workers.engine.core import Engine
    from engine_workers.worker.actor import Worker

    cfg = worker_config_from_args(args)
    loop = asyncio.get_running_loop()
    # The bus first: a wrong or unreachable broker is reported in seconds, not after a model load
    # that takes minutes on a GPU host. The group is joined only once the engine is ready.
    async with connect(args.bus) as bus:
        engine = await asyncio.to_thread(Engine, engine_config_from_args(args))
        worker = Worker(cfg, bus, engine)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_drain)
        async with worker:
            freeze_heap()  # the model and imports out of the GC's full collections
            print(f"worker {cfg.worker_id} ready: model {cfg.model}, group {cfg.group}", flush=True)
            return await worker.run()


def _worker(args: argparse.Namespace) -> int:
    return run_loop(_serve(args))


def register(sub: argparse._SubParsersAction, _bench: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="serve one engine from the bus (one actor per GPU)")
    add_engine_args(p)
    add_worker_args(p)
    p.set_defaults(func=_worker)
