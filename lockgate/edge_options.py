"""The edge's limits on hostile or unlucky traffic, shared by ``lockgate edge`` and ``lockgate serve``
(docs/protocol.md, "Limits"): declared once so the embedded server cannot drift from the edge."""

from __future__ import annotations

import argparse
from typing import TypedDict

from lockgate.options import env_default


def add_edge_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--publish-timeout", type=float, default=env_default("publish-timeout", 5.0),
                   help="seconds to wait for the bus to take a request; past it (broker down) the client gets "
                        "503 (env LOCKGATE_PUBLISH_TIMEOUT)")
    p.add_argument("--max-connections-per-key", type=int, default=env_default("max-connections-per-key", 256),
                   help="open WebSocket connections one API key may hold, 0 = unlimited; more get HTTP 429 "
                        "(env LOCKGATE_MAX_CONNECTIONS_PER_KEY)")
    p.add_argument("--grammar-compile-timeout", type=float, default=env_default("grammar-compile-timeout", 5.0),
                   help="seconds a structured-output constraint may take to compile at admission; longer is a 400 "
                        "(env LOCKGATE_GRAMMAR_COMPILE_TIMEOUT)")
    p.add_argument("--fleet-limits", action=argparse.BooleanOptionalAction, default=env_default("fleet-limits", True),
                   help="share each API key's limits across all live edges by heartbeats on <ns>.edges (default on; "
                        "off: each edge process enforces every key's whole limits) (env LOCKGATE_FLEET_LIMITS)")
    p.add_argument("--fleet-sync-interval", type=float, default=env_default("fleet-sync-interval", 0.5),
                   help="seconds between an edge's fleet-limit heartbeats (env LOCKGATE_FLEET_SYNC_INTERVAL)")
    p.add_argument("--fleet-edge-stale", type=float, default=env_default("fleet-edge-stale", 3.0),
                   help="seconds (of the bus's clock) after which a silent edge's share is freed; an edge that cannot "
                        "read its own heartbeat back for half as long refuses keys with limits (503); at least 4 x "
                        "--fleet-sync-interval (env LOCKGATE_FLEET_EDGE_STALE)")


class EdgeLimits(TypedDict):
    publish_timeout_s: float
    max_connections_per_key: int
    grammar_compile_timeout_s: float
    fleet_limits: bool
    fleet_sync_interval_s: float
    fleet_edge_stale_s: float


def edge_limits(args: argparse.Namespace) -> EdgeLimits:
    """The limits as ``EdgeConfig`` keyword arguments (EdgeConfig checks their ranges)."""
    return {"publish_timeout_s": args.publish_timeout, "max_connections_per_key": args.max_connections_per_key,
            "grammar_compile_timeout_s": args.grammar_compile_timeout, "fleet_limits": args.fleet_limits,
            "fleet_sync_interval_s": args.fleet_sync_interval, "fleet_edge_stale_s": args.fleet_edge_stale}
