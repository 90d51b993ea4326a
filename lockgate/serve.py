"""``lockgate serve``: the whole platform in one process — edge + one worker + the in-memory bus.

This is the embedded default behind ``make serve``: no Kafka, no external services. The same
``Edge`` and ``Worker`` classes run here as in a distributed deployment; only the bus differs.

Shutdown (SIGINT/SIGTERM): the edge stops accepting, the worker drains running requests up to its
grace period, then the bus closes. Each component is an ``async with`` owner of its tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from lockgate.edge_options import add_edge_limits, edge_limits
from lockgate.openai_options import add_openai_port, batch_options, openai_base_url, openai_port
from lockgate.options import add_engine_args, engine_config_from_args, env_default
from lockgate.runtime import freeze_heap, run_loop
from lockgate.slo_options import add_shed_flags, shed_config
from lockgate.worker_flags import add_worker_flags, worker_config_from_args

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction, _bench: argparse._SubParsersAction | None = None) -> None:
    p = sub.add_parser("serve", help="embedded platform: edge + worker + in-memory bus, one process")
    add_engine_args(p)
    p.add_argument("--host", default=env_default("host", "127.0.0.1"), help="edge listen address [LOCKGATE_HOST]")
    p.add_argument("--port", type=int, default=env_default("port", 8765), help="edge port [LOCKGATE_PORT]")
    add_openai_port(p)
    add_edge_limits(p)
    add_shed_flags(p, ttft=False)  # the TTFT targets: the worker's --slo-ttft-ms, one flag for both
    p.add_argument("--keys", default=env_default("keys", None), help="API key file; none = dev mode [LOCKGATE_KEYS]")
    p.add_argument("--bus", default=env_default("serve-bus", "memory://lockgate"),
                   help="bus URL; memory:// keeps everything in-process [LOCKGATE_SERVE_BUS]")
    add_worker_flags(p)
    p.set_defaults(func=_serve)


async def run_embedded(args: argparse.Namespace, ready: asyncio.Future | None = None, stop: asyncio.Event | None = None,
                       freeze: bool = True) -> int:
    """Run until ``stop`` is set (or a signal). ``ready`` receives the edge's bound port."""
    import bus as busmod
    from edge.config import EdgeConfig, load_keys
    from edge.server import Edge
    from engine_workers.engine.core import Engine
    from engine_workers.worker.actor import Worker
    from lockgate.commands.edge import DEV_BANNER
    from lockgate.runtime import raise_nofile
    from lockgate.telemetry import expose_metrics, tracer_for
    from tokenization.model_store import model_name

    worker_cfg = worker_config_from_args(args, model_name(args.model))
    name, layout = worker_cfg.model, worker_cfg.layout
    keys = load_keys(args.keys) if args.keys else None
    engine = await asyncio.to_thread(Engine, engine_config_from_args(args))
    edge_cfg = EdgeConfig(model=name, model_path=str(engine.loaded.path), host=args.host, port=args.port, keys=keys, layout=layout,
                          openai_port=openai_port(args), tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser,
                          embedding_pooling=args.embedding_pooling, **edge_limits(args), **batch_options(args),
                          **shed_config(args, worker_cfg.slo_ttft_ms),
                          lora_modules=engine.lora.names if engine.lora is not None else ())
    if edge_cfg.dev_mode:
        print(DEV_BANNER.format(tier=edge_cfg.dev_tier), file=sys.stderr, flush=True)
    raise_nofile()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    async with tracer_for(args, "serve") as tracer, busmod.connect(args.bus) as bus:
        await bus.ensure_topics(layout.model_specs(name))
        async with Worker(worker_cfg, bus, engine, tracer=tracer) as worker, Edge(edge_cfg, bus, tracer=tracer) as edge:
            expose_metrics(tracer, edge.metrics.registry)  # one exporter: its counters once, on the edge's /metrics
            if freeze:  # start-up state out of the GC's full collections (lockgate.runtime.freeze_heap)
                freeze_heap()
            print(f"lockgate serving {name} at http://{args.host}:{edge.port}/  (WebSocket: ws://{args.host}:{edge.port}/ws)", flush=True)
            if edge.openai_port is not None:
                print(f"OpenAI-compatible API: {openai_base_url(args.host, edge.openai_port)}  (model {name!r})",
                      flush=True)
                print(f"Anthropic Messages API: {openai_base_url(args.host, edge.openai_port).removesuffix('/v1')}",
                      flush=True)
            if ready is not None and not ready.done():
                ready.set_result(edge.port)
            # until a stop, or the engine's step loop crashes (a tensor-parallel rank died): then
            # exit non-zero at once, as the worker command does
            stopped, crash = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(worker.aengine.crashed())
            await asyncio.wait([stopped, crash], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if crash.done():
                # Exit at once, as a killed worker would: the edge's open requests wait for replies
                # no engine will send, and a graceful stop would hold the exit for aiohttp's
                # shutdown timeout (60 s). The other ranks are already stopped (TpGroup.fail).
                print(f"lockgate: engine failed, exiting: {crash.result()}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(1)
            crash.cancel()
            print("lockgate: shutting down (draining running requests)", file=sys.stderr, flush=True)
            await edge.stop()
            await worker.drain()
    return 0


def _serve(args: argparse.Namespace) -> int:
    return run_loop(run_embedded(args))
