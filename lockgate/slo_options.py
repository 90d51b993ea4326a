"""The edge's load-shedding and SLO flags, declared once for ``lockgate edge`` and ``lockgate serve``
(docs/worker.md, "SLOs"; ``edge/admission/shedding.py``). ``serve`` takes the TTFT targets from the
worker's ``--slo-ttft-ms`` (``lockgate/worker_flags.py``: one flag for both halves of the process);
``edge`` declares it here. Nothing heavy at import."""

from __future__ import annotations

import argparse
from typing import TypedDict

from lockgate.options import env_default
from lockgate.worker_flags import per_tier_ms

DEFAULT_SLO_WAIT = "2,5,60"
DEFAULT_SLO_TTFT_MS = "500,2000,30000"


def per_tier(kind: type, what: str):
    """An argparse type: ``p0,p1,p2`` values of ``kind``, each >= 0."""

    def parse(value: str) -> tuple:
        try:
            parts = tuple(kind(x) for x in str(value).split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected three {what} p0,p1,p2, got {value!r}") from None
        if len(parts) != 3 or any(p < 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected three {what} >= 0 p0,p1,p2, got {value!r}")
        return parts

    return parse


def add_shed_flags(p: argparse.ArgumentParser, ttft: bool) -> None:
    """``--slo-wait``, ``--max-queue-depth``, ``--slo-demote``; with ``ttft``, ``--slo-ttft-ms`` too."""
    p.add_argument("--slo-wait", type=per_tier(float, "seconds"), default=env_default("slo-wait", DEFAULT_SLO_WAIT),
                   help=f"max predicted queue wait per tier p0,p1,p2 in seconds before shedding (default "
                        f"{DEFAULT_SLO_WAIT}) [LOCKGATE_SLO_WAIT]")
    p.add_argument("--max-queue-depth", type=per_tier(int, "counts"), default=env_default("max-queue-depth", "0,0,0"),
                   help="shed a tier when every live worker queues at least this many of its requests, p0,p1,p2; "
                        "0 = no limit (default 0,0,0) [LOCKGATE_MAX_QUEUE_DEPTH]")
    p.add_argument("--slo-demote", action=argparse.BooleanOptionalAction, default=env_default("slo-demote", False),
                   help="a request whose tier cannot meet its TTFT target goes to the first lower tier that can, "
                        "instead of a 503 (default off) [LOCKGATE_SLO_DEMOTE]")
    if ttft:
        p.add_argument("--slo-ttft-ms", type=per_tier_ms, default=env_default("slo-ttft-ms", DEFAULT_SLO_TTFT_MS),
                       help=f"time-to-first-token targets p0,p1,p2 in ms: a request whose tier's predicted wait "
                            f"passes its target is refused early (default {DEFAULT_SLO_TTFT_MS}) [LOCKGATE_SLO_TTFT_MS]")


class ShedConfig(TypedDict):
    slo_wait_s: tuple[float, ...]
    max_queue_depth: tuple[int, int, int]
    slo_demote: bool
    slo_ttft_ms: tuple[float, ...]


def shed_config(args: argparse.Namespace, slo_ttft_ms: tuple[float, ...] | None = None) -> ShedConfig:
    """The flags as ``EdgeConfig`` keyword arguments (EdgeConfig checks them again);
    ``slo_ttft_ms``: the targets when not ``args.slo_ttft_ms`` (``serve``: its worker's)."""
    depth = tuple(args.max_queue_depth)
    return {"slo_wait_s": tuple(args.slo_wait), "max_queue_depth": (depth[0], depth[1], depth[2]),
            "slo_demote": bool(args.slo_demote),
            "slo_ttft_ms": tuple(args.slo_ttft_ms if slo_ttft_ms is None else slo_ttft_ms)}
