"""CLI of the bus package: ``lockgate kafka``, ``lockgate topics ensure|delete|list``, ``lockgate dlq``
(``lockgate bench bus`` is :mod:`benchmarks.cli`'s).

Imports nothing heavy at module level (aiokafka loads inside the commands). Every flag has its
``LOCKGATE_<FLAG>`` environment twin through :func:`lockgate.options.env_default`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC
from pathlib import Path

from lockgate.options import env_default


def register(sub: argparse._SubParsersAction, _bench: argparse._SubParsersAction) -> None:
    kafka = sub.add_parser("kafka", help="run a local Apache Kafka (KRaft) on 127.0.0.1 for dev/tests")
    kafka.add_argument("action", choices=("start", "stop", "status"))
    kafka.add_argument("--nodes", type=int, choices=(1, 3), default=env_default("kafka-nodes", 1),
                       help="1, or 3 for a loopback cluster for fault tests (env LOCKGATE_KAFKA_NODES)")
    kafka.add_argument("--port", type=int, default=env_default("kafka-port", 9092),
                       help="client port of node 0; node i uses port+i, its controller port+100+i (env LOCKGATE_KAFKA_PORT)")
    kafka.add_argument("--dir", default=env_default("kafka-dir", "~/.cache/lockgate/kafka"),
                       help="jar cache and cluster data (env LOCKGATE_KAFKA_DIR)")
    kafka.add_argument("--timeout", type=float, default=env_default("kafka-timeout", 120.0),
                       help="seconds to wait for the broker to answer (env LOCKGATE_KAFKA_TIMEOUT)")
    kafka.add_argument("--fresh", action="store_true", default=env_default("kafka-fresh", False),
                       help="start: wipe the cluster's data first (env LOCKGATE_KAFKA_FRESH)")
    kafka.set_defaults(func=_kafka)

    topics = sub.add_parser("topics", help="manage bus topics")
    tsub = topics.add_subparsers(dest="topics_action", metavar="ACTION", required=True)
    ensure = tsub.add_parser("ensure", help="create the topics a model needs (idempotent)")
    _topic_args(ensure, "create")
    ensure.add_argument("--model", action="append", default=None, required=env_default("model", None) is None,
                        help="model as `lockgate worker --model` takes it (`default`, a folder: its served name); "
                             "repeat for several (env LOCKGATE_MODEL)")
    ensure.add_argument("--partitions", type=int, default=env_default("partitions", 6),
                        help="partitions per priority topic (env LOCKGATE_PARTITIONS)")
    ensure.add_argument("--replication", type=int, default=env_default("replication", 1),
                        help="replication factor (env LOCKGATE_REPLICATION)")
    ensure.set_defaults(func=_topics_ensure)
    delete = tsub.add_parser("delete", help="delete topics with their records (skips missing ones)")
    _topic_args(delete, "delete")
    delete.add_argument("names", nargs="*", metavar="TOPIC", help="topic names")
    delete.add_argument("--model", action="append", default=[],
                        help="also the model's priority topics (p0-p2); repeatable")
    delete.add_argument("--shared", action="store_true",
                        help="also the namespace's shared control, status, dead-letter and usage topics (every model "
                             "of the namespace uses them; the dead letters are lost)")
    delete.add_argument("--prefix", default=None,
                        help="also every existing topic whose name starts with PREFIX (not empty), e.g. an old "
                             "benchmark namespace")
    delete.set_defaults(func=_topics_delete)
    listing = tsub.add_parser("list", help="list the topics (the broker's internal ones left out)")
    _bus_args(listing)
    listing.add_argument("--prefix", default="", help="only names that start with PREFIX")
    listing.set_defaults(func=_topics_list)

    dlq = sub.add_parser("dlq", help="list the dead letters: undecodable records, requests whose reply topic is missing")
    _bus_args(dlq)
    dlq.add_argument("--namespace", default=env_default("namespace", "lockgate"),
                     help="topic name prefix (env LOCKGATE_NAMESPACE)")
    dlq.add_argument("--since", default="1d",
                     help="dead-lettered at or after: ms since the epoch, ISO 8601 (naive = UTC), now, or 15m / 2h / "
                          "1d ago (default 1d)")
    dlq.add_argument("--until", default="now", help="and at or before (same forms; default now)")
    dlq.add_argument("--limit", type=int, default=100, help="at most this many, oldest first (default 100)")
    dlq.add_argument("--json", action="store_true", help="one JSON object per dead letter instead of a line")
    dlq.set_defaults(func=_dlq)



def _bus_args(p: argparse.ArgumentParser) -> None:
    """The flags every ``topics`` action takes."""
    p.add_argument("--bus", default=env_default("bus", "kafka://127.0.0.1:9092"), help="bus URL (env LOCKGATE_BUS)")
    p.add_argument("--connect-timeout", type=float, default=env_default("connect-timeout", 15.0),
                   help="seconds to wait for the broker (env LOCKGATE_CONNECT_TIMEOUT)")


def _topic_args(p: argparse.ArgumentParser, verb: str) -> None:
    """The flags ``topics ensure`` and ``topics delete`` take."""
    _bus_args(p)
    p.add_argument("--namespace", default=env_default("namespace", "lockgate"),
                   help="topic name prefix (env LOCKGATE_NAMESPACE)")
    p.add_argument("--reply", action="append", default=[], metavar="OWNER",
                   help=f"also {verb} the reply topic of OWNER (edge instance, batch job); repeatable")


def _kafka(args: argparse.Namespace) -> int:
    try:
        from devtools import kafka_local  # a dev tool: a source checkout has it, the wheel does not
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "devtools":
            raise
        raise ValueError("`lockgate kafka` is a development tool: it runs from a source checkout (`make install`)") from None

    base = Path(args.dir).expanduser()
    try:
        if args.action == "start":
            info = kafka_local.start(args.nodes, args.port, base, timeout_s=args.timeout, fresh=args.fresh)
            print(f"kafka running: bootstrap {info.bootstrap} pids {list(info.pids)} dir {info.directory}")
        elif args.action == "stop":
            pids = kafka_local.stop(args.nodes, args.port, base)
            print(f"kafka stopped: pids {pids}" if pids else "kafka: nothing of ours was running")
        else:
            info = kafka_local.status(args.nodes, args.port, base)
            state = "running" if info.running else ("partly running" if any(info.pids) else "stopped")
            print(f"kafka {state}: bootstrap {info.bootstrap} pids {list(info.pids)} dir {info.directory}")
            return 0 if info.running else 3
    except kafka_local.KafkaLocalError as exc:
        print(f"lockgate kafka {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def _on_bus(args: argparse.Namespace, command: str, use):
    """``await use(bus)`` on a bus connected to ``--bus``; ``None`` after printing why when the bus
    fails (``BusError``), so each action exits 1 with one line instead of a traceback."""
    import asyncio

    from bus import BusError, connect

    kwargs = {"connect_timeout_s": args.connect_timeout} if args.bus.startswith("kafka:") else {}

    async def run():
        async with connect(args.bus, **kwargs) as bus:
            return await use(bus)

    try:
        return asyncio.run(run())
    except BusError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return None


def _topics_ensure(args: argparse.Namespace) -> int:
    from bus import TopicLayout
    from tokenization.model_store import model_name

    # The served name, as `lockgate worker` and `lockgate edge` derive it: `default` or a folder
    # path would otherwise make topics that no worker reads.
    models = [model_name(m) for m in (args.model or [str(env_default("model", ""))])]
    if args.partitions < 1 or args.replication < 1:
        raise ValueError("--partitions and --replication must be >= 1")
    layout = TopicLayout(namespace=args.namespace, partitions=args.partitions, replication=args.replication)
    specs = {s.name: s for m in models for s in layout.model_specs(m)}
    specs.update({s.name: s for s in (layout.reply_spec(o) for o in args.reply)})
    created = _on_bus(args, "lockgate topics ensure", lambda bus: bus.ensure_topics(specs.values()))
    if created is None:
        return 1
    for name in sorted(specs):
        print(f"{'created' if name in created else 'exists '} {name}")
    return 0


def _topics_delete(args: argparse.Namespace) -> int:
    from bus import TopicLayout, checked_topic_names
    from tokenization.model_store import model_name

    layout = TopicLayout(namespace=args.namespace)
    models = [model_name(m) for m in args.model]  # as in ensure
    shared = ([layout.control_topic, layout.status_topic, layout.dead_letter_topic, layout.usage_topic]
              if args.shared else [])
    # checked before connecting: a bad name fails at once, not after the broker answers
    names = checked_topic_names([*args.names, *(t for m in models for t in layout.request_topics(m)), *shared,
                                 *(layout.reply_topic(o) for o in args.reply)])
    if args.prefix is not None and not args.prefix:
        raise ValueError("--prefix must not be empty (it would delete every topic)")
    if not names and args.prefix is None:
        raise ValueError("name the topics to delete: TOPIC arguments, --prefix, --model, --shared or --reply")

    async def delete(bus) -> list[str]:
        if args.prefix is not None:
            names.extend(t for t in await bus.list_topics(args.prefix) if t not in names)
        return await bus.delete_topics(names)

    deleted = _on_bus(args, "lockgate topics delete", delete)
    if deleted is None:
        return 1
    for name in names:
        print(f"{'deleted' if name in deleted else 'missing'} {name}")
    return 0


def _topics_list(args: argparse.Namespace) -> int:
    names = _on_bus(args, "lockgate topics list", lambda bus: bus.list_topics(args.prefix))
    if names is None:
        return 1
    try:
        sys.stdout.write("".join(f"{n}\n" for n in names))
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def _dlq(args: argparse.Namespace) -> int:
    from datetime import datetime

    from bus import (
        DecodeError,
        InferenceRequest,
        TopicLayout,
        decode,
        parse_time_ms,  # the time forms `lockgate replay` takes
        read_dead_letters,
    )

    since, until = parse_time_ms(args.since), parse_time_ms(args.until)
    if until < since:
        raise ValueError(f"--until ({args.until}) is before --since ({args.since})")
    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    layout = TopicLayout(namespace=args.namespace)
    got = _on_bus(args, "lockgate dlq", lambda bus: read_dead_letters(bus, layout, since, until, limit=args.limit))
    if got is None:
        return 1
    letters, foreign = got
    for dl in letters:
        try:
            msg = decode(dl.value)
        except DecodeError:
            msg = None
        req = msg if isinstance(msg, InferenceRequest) else None
        at = datetime.fromtimestamp(dl.dead_at_ms / 1000, UTC).isoformat(timespec="milliseconds")
        source = f"{dl.source_topic}[{dl.source_partition}]@{dl.source_offset}"
        if args.json:
            print(json.dumps({"dead_at": at, "source": source, "reason": dl.reason,
                              "request_id": req.request_id if req else None, "reply_to": req.reply_to if req else None,
                              "key": dl.key.decode("utf-8", "replace") if dl.key is not None else None,
                              "bytes": len(dl.value)}))
        else:
            what = f"request {req.request_id} (reply_to {req.reply_to})" if req else f"{len(dl.value)} bytes"
            print(f"{at}  {source}  {what}: {dl.reason}")
    print(f"{len(letters)} dead letter{'s' * (len(letters) != 1)} in {layout.dead_letter_topic} "
          f"({'limit reached' if len(letters) + foreign >= args.limit else 'all in the window'})"
          + (f"; {foreign} other records there (no dlq.* headers)" if foreign else ""), file=sys.stderr)
    return 0
