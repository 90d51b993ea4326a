"""CLI of the worker: ``lockgate worker`` (``lockgate bench e2e`` and ``bench priority`` are
:mod:`benchmarks.cli`'s).

Listed in ``lockgate.cli.COMMANDS``; nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from lockgate.options import add_engine_args, engine_config_from_args, env_default
from lockgate.runtime import freeze_heap, run_loop
from lockgate.worker_flags import add_worker_flags
from lockgate.worker_flags import worker_config_from_args as worker_config

log = logging.getLogger(__name__)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """``--bus`` and the worker table (:mod:`lockgate.worker_flags`, shared with ``lockgate serve``)."""
    p.add_argument("--bus", default=env_default("bus", "kafka://127.0.0.1:9092"),
                   help="bus URL: kafka://host:port[?session_timeout_ms=..] or memory://name [LOCKGATE_BUS]")
    add_worker_flags(p)


def worker_config_from_args(args: argparse.Namespace):
    from tokenization.model_store import model_name

    return worker_config(args, model_name(args.model))  # same name the edge uses


async def _serve(args: argparse.Namespace) -> int:
    from bus import connect
    from engine_workers.engine.core import Engine
    from engine_workers.worker.actor import Worker
    from lockgate.telemetry import expose_metrics, tracer_for

    cfg = worker_config_from_args(args)
    loop = asyncio.get_running_loop()
    # The bus first: a wrong or unreachable broker is reported in seconds, not after a model load
    # that takes minutes on a GPU host. The group is joined only once the engine is ready.
    async with tracer_for(args, "worker") as tracer, connect(args.bus) as bus:
        engine = await asyncio.to_thread(Engine, engine_config_from_args(args))
        worker = Worker(cfg, bus, engine, tracer=tracer)
        expose_metrics(tracer, worker.metrics.registry)
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
