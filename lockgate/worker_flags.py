"""The worker's flags, declared once: each row maps a flag to its :class:`WorkerConfig` field, its
environment-variable twin (``LOCKGATE_`` + the flag's name), its default and its help.

``lockgate worker`` and ``lockgate serve`` both add the whole table (:func:`add_worker_flags`) and
build the config from it (:func:`worker_config_from_args`), so a flag added here reaches both and
they cannot drift. ``--bus`` is not a row: its default differs by command (Kafka for a worker,
the in-process bus for ``serve``). Nothing heavy at import.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lockgate.options import env_default

if TYPE_CHECKING:
    from engine_workers.worker.config import WorkerConfig


@dataclass(frozen=True, slots=True)
class WorkerFlag:
    flag: str  # without the leading dashes; the env twin is LOCKGATE_<FLAG>
    field: str | None  # the WorkerConfig field it sets; None: the topology (see worker_config_from_args)
    default: Any
    help: str
    type: Callable[[str], Any] | None = None  # None: str, or a bool flag when the default is a bool
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def env(self) -> str:
        return "LOCKGATE_" + self.flag.upper().replace("-", "_")


def optional_float(value: str) -> float | None:
    """A float, or None for ``none``/``off`` (argparse type)."""
    if value.strip().lower() in ("none", "off"):
        return None
    return float(value)


def per_tier_ms(value: str) -> tuple[float, ...]:
    """``p0,p1,p2`` milliseconds, each > 0 (argparse type)."""
    try:
        parts = tuple(float(x) for x in str(value).split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three numbers p0,p1,p2 (ms), got {value!r}") from None
    if len(parts) != 3 or not all(p > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected three numbers > 0 p0,p1,p2 (ms), got {value!r}")
    return parts


WORKER_FLAGS: tuple[WorkerFlag, ...] = (
    WorkerFlag("served-model-name", None, None,
               "model name on the bus (topics, request.model); default: --model"),
    WorkerFlag("namespace", None, "lockgate", "topic namespace"),
    WorkerFlag("partitions", None, 6, "partitions per priority topic when creating them", int),
    WorkerFlag("worker-id", "worker_id", None, "default: worker-<random>"),
    WorkerFlag("intake-mode", "intake_mode", "aging", "admission order", choices=("aging", "strict", "fifo")),
    WorkerFlag("aging-period", "aging_period_s", 2.0, "seconds of waiting worth one tier step (aging mode)", float),
    WorkerFlag("fair-share", "fair_share", True,
               "within a tier, share admissions across tenants by weighted fair queueing over tokens; "
               "--no-fair-share: FIFO per tier"),
    WorkerFlag("age-credit-periods", "age_credit_periods", 1.0,
               "count at most this many aging periods of a record's time on the topic (protects fresh "
               "p0 from an old p2 backlog and from a forged enqueued_at; 'none' = all of it)", optional_float),
    WorkerFlag("prefetch-per-tier", "prefetch_per_tier", 4, "requests held per tier beyond free sequence slots", int),
    WorkerFlag("drain-grace", "drain_grace_s", 30.0, "SIGTERM: seconds to let running requests finish", float),
    WorkerFlag("commit-interval", "commit_interval_s", 1.0,
               "commit finished work at most every N s; drain, rebalance and stop commit at once", float),
    WorkerFlag("send-failure-reruns", "send_failure_reruns", 2,
               "a request whose replies could not be sent runs again this many times, then is answered "
               "with an error", int),
    WorkerFlag("max-reply-record-bytes", "max_reply_record_bytes", 1 << 20,
               "split a step's coalesced replies into records of at most this size; keep it at or under "
               "the producer's max_request_size", int),
    WorkerFlag("slo-ttft-ms", "slo_ttft_ms", (500.0, 2000.0, 30000.0),
               "time-to-first-token targets p0,p1,p2 in ms (default 500,2000,30000; p0: the design guide's); "
               "the edge refuses a request whose predicted wait passes its tier's", per_tier_ms),
    WorkerFlag("slo-tpot-ms", "slo_tpot_ms", (50.0, 100.0, 250.0),
               "time-per-output-token targets p0,p1,p2 in ms (default 50,100,250; p0: the design guide's); "
               "steps are sized so the running decodes keep theirs", per_tier_ms),
    WorkerFlag("heartbeat", "heartbeat_s", 0.2, "status period, s (also the failover's clock)", float),
    WorkerFlag("failover", "failover", True,
               "take over the requests of a peer whose heartbeats stopped, without waiting for the group's "
               "session timeout (docs/worker.md, Failover)"),
    WorkerFlag("failover-detect", "failover_detect_s", None,
               "seconds of heartbeat silence after which a peer is presumed dead (unset: 3 heartbeat periods)",
               float),
    WorkerFlag("metrics-host", "metrics_host", "127.0.0.1", "address of the worker's /healthz /readyz /metrics"),
    WorkerFlag("metrics-port", "metrics_port", None,
               "worker /healthz /readyz /metrics port (0 = any; unset = off; `serve`'s edge serves its own "
               "/metrics on the edge port)", int),
)


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    """Add every row of :data:`WORKER_FLAGS` to ``p``, in a group "worker"."""
    g = p.add_argument_group("worker")
    for f in WORKER_FLAGS:
        default = env_default(f.flag, f.default)
        if f.type in (optional_float, per_tier_ms) and os.environ.get(f.env) is not None:
            default = os.environ[f.env]  # a string default goes through ``type`` ("none" included)
        text = f"{f.help} [{f.env}]"
        if isinstance(f.default, bool):
            g.add_argument(f"--{f.flag}", action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            g.add_argument(f"--{f.flag}", type=f.type or str, choices=f.choices, default=default, help=text)


def worker_config_from_args(args: argparse.Namespace, model: str) -> WorkerConfig:
    """The :class:`WorkerConfig` the table's flags in ``args`` describe. ``model``: the name of the
    loaded model (``--served-model-name`` wins over it, as at the edge)."""
    from bus import TopicLayout
    from engine_workers.worker.config import WorkerConfig

    kw = {f.field: getattr(args, f.dest) for f in WORKER_FLAGS if f.field is not None}
    if kw["worker_id"] is None:
        del kw["worker_id"]  # the config draws a random one
    return WorkerConfig(model=args.served_model_name or model,
                        layout=TopicLayout(namespace=args.namespace, partitions=args.partitions), **kw)
