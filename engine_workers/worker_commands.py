"""CLI of the worker: ``lockgate worker``, ``lockgate bench e2e``, ``lockgate bench priority``.

Registered by ``engine_workers.commands``; nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from engine_workers.cli import env_default, freeze_heap, run_loop
from engine_workers.commands import add_engine_args, engine_config_from_args

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
    g.add_argument("--prefetch-per-tier", type=int, default=env_default("prefetch-per-tier", 4),
                   help="requests held per tier beyond free sequence slots [LOCKGATE_PREFETCH_PER_TIER]")
    g.add_argument("--drain-grace", type=float, default=env_default("drain-grace", 30.0),
                   help="SIGTERM: seconds to let running requests finish [LOCKGATE_DRAIN_GRACE]")
    g.add_argument("--commit-interval", type=float, default=env_default("commit-interval", 1.0),
                   help="commit finished work at most every N s; drain, rebalance and stop commit at once "
                        "[LOCKGATE_COMMIT_INTERVAL]")
    g.add_argument("--heartbeat", type=float, default=env_default("heartbeat", 0.5), help="status period, s [LOCKGATE_HEARTBEAT]")
    g.add_argument("--metrics-host", default=env_default("metrics-host", "127.0.0.1"), help="[LOCKGATE_METRICS_HOST]")
    g.add_argument("--metrics-port", type=int, default=env_default("metrics-port", None),
                   help="/healthz /readyz /metrics port (0 = any; unset = off) [LOCKGATE_METRICS_PORT]")


def worker_config_from_args(args: argparse.Namespace):
    from bus.topics import TopicLayout
    from engine_workers.model_store import model_name
    from engine_workers.worker_config import WorkerConfig

    kw = {"worker_id": args.worker_id} if args.worker_id else {}
    return WorkerConfig(
        model=args.served_model_name or model_name(args.model),  # same name the edge uses
        layout=TopicLayout(namespace=args.namespace, partitions=args.partitions),
        intake_mode=args.intake_mode, aging_period_s=args.aging_period, prefetch_per_tier=args.prefetch_per_tier,
        heartbeat_s=args.heartbeat, drain_grace_s=args.drain_grace, commit_interval_s=args.commit_interval,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port, **kw,
    )


async def _serve(args: argparse.Namespace) -> int:
    from bus import connect
    from engine_workers.engine import Engine
    from engine_workers.worker import Worker

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


def _bench_e2e(args: argparse.Namespace) -> int:
    from engine_workers.bench_e2e import run

    return run(args)


def _bench_priority(args: argparse.Namespace) -> int:
    from engine_workers.bench_priority import run

    return run(args)


def register(sub, bench) -> None:
    p = sub.add_parser("worker", help="serve one engine from the bus (one actor per GPU)")
    add_engine_args(p)
    add_worker_args(p)
    p.set_defaults(func=_worker)

    from engine_workers.bench_priority import add_args as add_priority_args

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

    pr = bench.add_parser("priority", help="fifo vs strict vs aging intake under the same overload (PNG plot)")
    add_priority_args(pr)
    pr.set_defaults(func=_bench_priority)
