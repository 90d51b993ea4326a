"""``lockgate edge``'s flags for the fleet's stored responses (docs/protocol.md, "Resuming a stream")
and the topic layout it shares with the workers (``--namespace``, ``--partitions``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypedDict

from lockgate.options import env_default

if TYPE_CHECKING:
    from bus import TopicLayout


def add_responses_store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", default=env_default("namespace", "lockgate"),
                   help="topic namespace, the workers' (env LOCKGATE_NAMESPACE)")
    p.add_argument("--partitions", type=int, default=env_default("partitions", 6),
                   help="partitions of the topics this edge creates (env LOCKGATE_PARTITIONS)")
    p.add_argument("--responses-retention", type=float, default=env_default("responses-retention", 3600.0),
                   help="seconds a stored response (and its resume position) is kept on the bus table "
                        "<ns>.table.responses, for every edge (env LOCKGATE_RESPONSES_RETENTION)")
    p.add_argument("--responses-max-stored", type=int, default=env_default("responses-max-stored", 100_000),
                   help="stored responses each edge holds in memory; the oldest are forgotten first "
                        "(env LOCKGATE_RESPONSES_MAX_STORED)")
    p.add_argument("--responses-max-bytes", type=int, default=env_default("responses-max-bytes", 1_000_000),
                   help="the largest stored response record (request + output); larger ones are not stored, "
                        "a larger background request is refused (env LOCKGATE_RESPONSES_MAX_BYTES)")

    p.add_argument("--responses-view-bytes", type=int, default=env_default("responses-view-bytes", 256 << 20),
                   help="the memory each edge's view of the stored responses may take (bytes); the oldest are "
                        "forgotten first (env LOCKGATE_RESPONSES_VIEW_BYTES)")


class ResponsesStore(TypedDict):
    layout: TopicLayout
    responses_retention_s: float
    responses_max_stored: int
    responses_max_bytes: int
    responses_view_bytes: int


def responses_store(args: argparse.Namespace) -> ResponsesStore:
    """The flags as ``EdgeConfig`` keyword arguments (EdgeConfig checks their ranges)."""
    from bus import TopicLayout  # bus loads with the edge, not with every CLI start
    return {"layout": TopicLayout(namespace=args.namespace, partitions=args.partitions),
            "responses_retention_s": args.responses_retention, "responses_max_stored": args.responses_max_stored,
            "responses_max_bytes": args.responses_max_bytes, "responses_view_bytes": args.responses_view_bytes}
