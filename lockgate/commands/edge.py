"""CLI: ``lockgate edge``, ``lockgate keys add`` (``lockgate bench edge`` is :mod:`benchmarks.cli`'s). Imports stay light here;
the server, transformers and websockets load inside the commands."""

from __future__ import annotations

import argparse
import sys

from lockgate.edge_options import add_edge_limits, edge_limits
from lockgate.lora_options import add_lora_module_arg
from lockgate.openai_options import add_openai_port, batch_options, openai_base_url, openai_port
from lockgate.options import env_default
from lockgate.responses_options import add_responses_store, responses_store
from lockgate.runtime import freeze_heap, raise_nofile, run_loop
from lockgate.slo_options import add_shed_flags, shed_config

DEV_BANNER = """
**********************************************************************
*  lockgate edge: DEV MODE (no --keys file)                          *
*  Every connection is admitted, with or without an API key, as      *
*  tenant 'dev' on tier p{tier} with no rate limits. Do not expose this.  *
**********************************************************************
"""


REUSE_PORT_WARNING = (
    "lockgate edge: WARNING: --reuse-port --no-fleet-limits: the per-key limits (requests_per_min, tokens_per_min, "
    "max_streams) are enforced per edge process; N processes sharing this port (or N edges) give a key up to N x "
    "its limits (docs/protocol.md, \"Fleet-wide limits\")")


def register(sub: argparse._SubParsersAction, _bench: argparse._SubParsersAction) -> None:
    p = sub.add_parser("edge", help="WebSocket edge: what chat frontends connect to")
    p.add_argument("--bus", default=env_default("bus", "kafka://127.0.0.1:9092"),
                   help="bus URL: kafka://host:port or memory://name (env LOCKGATE_BUS)")
    p.add_argument("--model", default=env_default("model", None),
                   help="model spec (default: SmolLM2-135M-Instruct) (env LOCKGATE_MODEL)")
    p.add_argument("--host", default=env_default("host", "127.0.0.1"), help="listen address (env LOCKGATE_HOST)")
    p.add_argument("--port", type=int, default=env_default("port", 8765), help="listen port (env LOCKGATE_PORT)")
    add_openai_port(p)
    p.add_argument("--keys", default=env_default("keys", None),
                   help="API key file (JSON lines, hashed); without it the edge runs in DEV MODE (env LOCKGATE_KEYS)")
    p.add_argument("--edge-id", default=env_default("edge-id", None), help="reply-topic owner name (default random)")
    p.add_argument("--limits-per-process", action="store_true", default=env_default("limits-per-process", False),
                   help="with --reuse-port, --no-fleet-limits and a key file: accept that each process enforces "
                        "the keys' limits on its own (N processes: up to N x a key's limits) "
                        "[LOCKGATE_LIMITS_PER_PROCESS]")
    p.add_argument("--reuse-port", action="store_true", default=env_default("reuse-port", False),
                   help="listen with SO_REUSEPORT, so several edge processes share the port (one core each) "
                        "(env LOCKGATE_REUSE_PORT)")
    add_shed_flags(p, ttft=True)
    p.add_argument("--max-frame-bytes", type=int, default=env_default("max-frame-bytes", 1 << 20))
    p.add_argument("--request-timeout", type=float, default=env_default("request-timeout", 300.0))
    add_edge_limits(p)
    add_responses_store(p)
    add_lora_module_arg(p, "LoRA adapters a request's model may name, routed to the served model's workers "
                           "with lora=<name> (name or name=path; the path is the workers' business); the edge "
                           "also learns the names the live workers' heartbeats list")
    p.add_argument("--models", nargs="+", default=str(env_default("models", "")).split(), metavar="NAME=MODEL",
                   help="more base models behind this edge beside --model, each NAME=model spec or folder (its "
                        "tokenizer, loaded on first use); their workers share the bus (docs/lora.md, \"Several "
                        "base models\") [LOCKGATE_MODELS, space-separated]")
    p.set_defaults(func=_edge)

    k = sub.add_parser("keys", help="API keys for the edge")
    ks = k.add_subparsers(dest="keys_command", metavar="ACTION")
    a = ks.add_parser("add", help="make a key, append its hashed entry to the key file, print the key once")
    a.add_argument("--tenant", required=True)
    a.add_argument("--tier", type=int, default=1, choices=(0, 1, 2))
    a.add_argument("--keys", default=env_default("keys", None), help="key file to append to (else print only)")
    a.add_argument("--requests-per-min", type=int, default=120)
    a.add_argument("--tokens-per-min", type=int, default=500_000)
    a.add_argument("--max-streams", type=int, default=16)
    a.add_argument("--weight", type=float, default=1.0, help="fair share within the tier at the workers")
    a.add_argument("--admin", action="store_true", help="the key may load and unload LoRA adapters (docs/lora.md)")
    a.set_defaults(func=_keys_add)



def _edge(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from edge.config import EdgeConfig, load_keys
    from tokenization.model_store import model_name, resolve_model

    keys = load_keys(args.keys) if args.keys else None
    path = resolve_model(args.model)
    kw = {"edge_id": args.edge_id} if args.edge_id else {}
    models = []
    for item in args.models or ():
        name, sep, spec = item.partition("=")
        if not sep or not name or not spec:
            raise ValueError(f"--models takes NAME=MODEL, got {item!r}")
        models.append((name, str(resolve_model(spec))))
    config = EdgeConfig(model=model_name(args.model), model_path=str(path), host=args.host, port=args.port,
                        keys=keys, **shed_config(args), max_frame_bytes=args.max_frame_bytes,
                        request_timeout_s=args.request_timeout, reuse_port=args.reuse_port,
                        **edge_limits(args), **responses_store(args),
                        openai_port=openai_port(args), tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, embedding_pooling=args.embedding_pooling,
                        **batch_options(args),
                        lora_modules=tuple(name for name, _ in args.lora_modules or ()), models=tuple(models), **kw)
    if config.dev_mode:
        print(DEV_BANNER.format(tier=config.dev_tier), file=sys.stderr, flush=True)
    if config.reuse_port and not config.dev_mode and not config.fleet_limits:
        if not args.limits_per_process:
            # Silently multiplying every key's limits by the number of processes is refused:
            # the operator says they mean it (docs/protocol.md, "Fleet-wide limits").
            raise ValueError("--reuse-port --no-fleet-limits with a key file multiplies every key's limits by the "
                             "number of edge processes (they are enforced per process); pass --limits-per-process "
                             "to accept that, or leave fleet limits on")
        print(REUSE_PORT_WARNING, file=sys.stderr, flush=True)

    async def main() -> None:
        import bus as busmod
        from edge.server import Edge
        from lockgate.telemetry import expose_metrics, tracer_for

        raise_nofile()
        b = busmod.connect(args.bus)
        await b.start()
        try:
            async with tracer_for(args, "edge") as tracer, Edge(config, b, tracer=tracer) as edge:
                expose_metrics(tracer, edge.metrics.registry)
                freeze_heap()
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stop.set)
                print(f"lockgate edge on http://{config.host}:{edge.port}/ (ws /ws), bus {args.bus}", flush=True)
                if edge.openai_port is not None:
                    print(f"OpenAI-compatible API: {openai_base_url(config.host, edge.openai_port)}", flush=True)
                await stop.wait()
                print(f"lockgate edge: shutting down ({len(edge.sessions)} connections to close)", file=sys.stderr,
                      flush=True)
        finally:
            await b.stop()

    run_loop(main())
    return 0


def _keys_add(args: argparse.Namespace) -> int:
    from edge.config import add_key

    key, entry = add_key(args.keys, args.tenant, args.tier, requests_per_min=args.requests_per_min,
                         tokens_per_min=args.tokens_per_min, max_streams=args.max_streams, weight=args.weight,
                         admin=args.admin)
    print(key)
    if args.keys:
        print(f"appended the hashed entry to {args.keys}; the key above is not stored anywhere", file=sys.stderr)
    else:
        print(entry.to_json())
    return 0
