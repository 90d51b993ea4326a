"""Kafka-only behaviour: start-up failure, broker-side errors, the local broker helper."""

from __future__ import annotations

import socket
import time

import pytest

from bus import BusError, TopicSpec, UnknownTopicError, connect
from devtools import kafka_local


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


async def test_unreachable_broker_raises_bus_error_within_timeout(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    port = closed_port()
    bus = connect(f"kafka://127.0.0.1:{port}?connect_timeout_s=2")
    t0 = time.monotonic()
    with caplog.at_level(logging.DEBUG), pytest.raises(BusError, match=f"127.0.0.1:{port} unreachable after 2s"):
        await bus.start()
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 6, f"gave up after {elapsed:.1f}s, configured 2s"
    # one clear error instead of aiokafka's ERROR line per attempt; the retries are at DEBUG
    assert not [r for r in caplog.records if r.name == "aiokafka" and r.levelno >= logging.ERROR]
    assert any("unreachable" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
    from bus.kafka.connect import BOOTSTRAP_FILTER

    assert BOOTSTRAP_FILTER not in logging.getLogger("aiokafka").filters, "gone once no start is retrying"
    await bus.stop()  # idempotent on a bus that never started
    with pytest.raises(BusError, match="not started"):
        await bus.send("t", b"x")


@pytest.mark.kafka
async def test_impossible_replication_is_a_clear_error(kafka_bootstrap: str) -> None:
    async with connect(f"kafka://{kafka_bootstrap}") as bus:
        with pytest.raises(BusError, match="cannot create topic .*InvalidReplicationFactor"):
            await bus.ensure_topics([TopicSpec("t.too-many-replicas", 1, replication=99)])
        with pytest.raises(UnknownTopicError, match="unknown topic"):
            await bus.partitions_for("t.never-created-by-anyone")


@pytest.mark.kafka
def test_local_broker_answers_metadata(kafka_bootstrap: str) -> None:
    host, port = kafka_bootstrap.split(",")[0].rsplit(":", 1)
    assert kafka_local.metadata_brokers(host, int(port)) >= 1


def test_local_broker_config_and_argument_checks(tmp_path) -> None:
    with pytest.raises(ValueError, match="--nodes must be 1 or 3"):
        kafka_local.status(nodes=2)
    with pytest.raises(ValueError, match="--port"):
        kafka_local.status(port=80)
    props = kafka_local._server_properties(1, 3, 19092, tmp_path)
    assert "controller.quorum.voters=0@127.0.0.1:19192,1@127.0.0.1:19193,2@127.0.0.1:19194" in props
    assert "listeners=PLAINTEXT://127.0.0.1:19093,CONTROLLER://127.0.0.1:19193" in props
    assert "offsets.topic.replication.factor=3" in props
    info = kafka_local.status(nodes=3, port=19092, base=tmp_path)
    assert not info.running and info.bootstrap == "127.0.0.1:19092,127.0.0.1:19093,127.0.0.1:19094"
    assert kafka_local.stop(nodes=3, port=19092, base=tmp_path) == []  # nothing of ours: nothing killed


@pytest.mark.kafka
def test_topics_ensure_then_delete_cli(kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]) -> None:
    import uuid

    from lockgate.cli import build_parser

    ns = f"t-cli-{uuid.uuid4().hex[:8]}"
    common = ["--bus", f"kafka://{kafka_bootstrap}", "--namespace", ns, "--model", "m", "--reply", "edge-1"]
    args = build_parser().parse_args(["topics", "ensure", *common, "--partitions", "2"])
    assert args.func(args) == 0
    made = sorted(line.split()[1] for line in capsys.readouterr().out.splitlines())
    assert len(made) == 8 and all(t.startswith(ns + ".") for t in made)  # 3 tiers, control, status, dlq, usage, reply

    # --model: that model's priority topics only; the namespace's shared topics stay
    args = build_parser().parse_args(["topics", "delete", *common, f"{ns}.never-made"])
    assert args.func(args) == 0
    out = dict(reversed(line.split()) for line in capsys.readouterr().out.splitlines())
    tiers = [t for t in made if ".req." in t]
    shared = [f"{ns}.control", f"{ns}.status", f"{ns}.dlq", f"{ns}.usage"]
    assert len(tiers) == 3 and sorted(shared) == sorted(set(made) - set(tiers) - {f"{ns}.reply.edge-1"})
    assert out == {**{t: "deleted" for t in tiers}, f"{ns}.reply.edge-1": "deleted", f"{ns}.never-made": "missing"}
    args = build_parser().parse_args(["topics", "delete", "--bus", f"kafka://{kafka_bootstrap}", "--namespace", ns,
                                      "--shared"])
    assert args.func(args) == 0
    assert sorted(line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("deleted")) \
        == sorted(shared)

    # --prefix: everything under a prefix, e.g. an old namespace (a fresh one: a just-deleted topic
    # is not re-created here); list shows what is there
    ns2 = ns + "-old"
    args = build_parser().parse_args(["topics", "ensure", "--bus", f"kafka://{kafka_bootstrap}", "--namespace", ns2,
                                      "--model", "m", "--partitions", "1"])
    assert args.func(args) == 0
    made2 = sorted(line.split()[1] for line in capsys.readouterr().out.splitlines())
    args = build_parser().parse_args(["topics", "list", "--bus", f"kafka://{kafka_bootstrap}", "--prefix", ns2])
    assert args.func(args) == 0
    assert capsys.readouterr().out.split() == made2
    args = build_parser().parse_args(["topics", "delete", "--bus", f"kafka://{kafka_bootstrap}", "--prefix", ns2 + "."])
    assert args.func(args) == 0
    assert sorted(line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("deleted")) \
        == made2

    args = build_parser().parse_args(["topics", "delete", "--bus", f"kafka://{kafka_bootstrap}"])
    with pytest.raises(ValueError, match="name the topics to delete"):
        args.func(args)
    args = build_parser().parse_args(["topics", "delete", "--bus", f"kafka://{kafka_bootstrap}", "--prefix", ""])
    with pytest.raises(ValueError, match="--prefix must not be empty"):
        args.func(args)
    args = build_parser().parse_args(["topics", "delete", "--bus", f"kafka://{kafka_bootstrap}", "bad name"])
    with pytest.raises(ValueError, match="invalid topic name"):
        args.func(args)


def test_transient_offset_lookup_errors_are_debug_lines(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from aiokafka.errors import NotLeaderForPartitionError, UnknownTopicOrPartitionError

    import bus.kafka.consumer  # noqa: F401 - installs the filter

    fetcher = logging.getLogger("aiokafka.consumer.fetcher")
    with caplog.at_level(logging.DEBUG):
        fetcher.error("Failed fetch offsets from %s: %s", 0, NotLeaderForPartitionError("t-0"))
        fetcher.error("Failed fetch offsets from %s: %s", 0, UnknownTopicOrPartitionError("t-0"))
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "UnknownTopicOrPartition" in errors[0].getMessage()  # only the real one
    assert any(r.levelno == logging.DEBUG and "NotLeaderForPartition" in r.getMessage() for r in caplog.records)


@pytest.mark.kafka
async def test_fresh_topics_consume_and_delete_without_error_logs(kafka_bootstrap: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import uuid

    async with connect(f"kafka://{kafka_bootstrap}") as bus:
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                name = f"t.fresh.{uuid.uuid4().hex[:8]}"
                await bus.ensure_topics([TopicSpec(name, 1)])
                async with bus.consumer([name], start_from="latest") as c:
                    await bus.send(name, b"x")
                    got = []
                    for _ in range(40):
                        got += await c.getmany(timeout_ms=250)
                        if got:
                            break
                    assert [r.value for r in got] == [b"x"]
                await bus.delete_topics([name])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


@pytest.mark.kafka
async def test_sends_right_after_ensure_topics_find_every_leader_ready(kafka_bootstrap: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """``ensure_topics`` returns once every new partition's leader has taken its leadership up, so
    the first sends are not refused (aiokafka would retry them with a WARNING each)."""
    import asyncio
    import logging
    import uuid

    async with connect(f"kafka://{kafka_bootstrap}") as bus:
        names = [f"t.lead.{uuid.uuid4().hex[:8]}" for _ in range(4)]
        try:
            with caplog.at_level(logging.INFO):
                for name in names:
                    assert await bus.ensure_topics([TopicSpec(name, 6)]) == [name]
                    metas = await asyncio.gather(*(bus.send(name, b"x", key=str(k).encode()) for k in range(24)))
                    assert {m.partition for m in metas} == set(range(6))
        finally:
            await bus.delete_topics(names)
    refused = [r.getMessage() for r in caplog.records if r.name.startswith("aiokafka") and r.levelno >= logging.WARNING]
    assert not refused, refused[:3]


@pytest.mark.kafka
def test_dlq_cli_lists_what_was_dead_lettered(kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`lockgate dlq`: a line per dead letter (the request and its reply topic when the value is a
    request, else its size), the count on stderr; --json; nothing (and no topic made) in a namespace
    that never dead-lettered anything; a bad --since named."""
    import asyncio
    import json
    import uuid

    from bus import Record, TopicLayout
    from bus.deadletter import send_dead_letter
    from bus.messages import InferenceRequest, SamplingParams, encode
    from lockgate.cli import build_parser, main

    layout = TopicLayout(namespace=f"t-dlq-{uuid.uuid4().hex[:8]}")
    url = f"kafka://{kafka_bootstrap}"
    src = layout.request_topic("m", 1)
    orphan = InferenceRequest("r-1", "m", (1, 2), SamplingParams(), layout.reply_topic("gone"))

    async def topics(prefix: str) -> list[str]:
        async with connect(url) as bus:
            return await bus.list_topics(prefix)

    async def letters() -> None:
        async with connect(url) as bus:
            await bus.ensure_topics(layout.model_specs("m"))  # as a worker does: the DLQ with them
            await send_dead_letter(bus, layout, Record(src, 0, 3, b"junk", b"{not json", 1), "not JSON")
            await send_dead_letter(bus, layout, Record(src, 0, 4, b"r-1", encode(orphan), 1),
                                   f"reply topic {orphan.reply_to!r} does not exist")

    args = build_parser().parse_args(["dlq", "--bus", url, "--namespace", layout.namespace])
    assert args.func(args) == 0
    assert capsys.readouterr().err.startswith(f"0 dead letters in {layout.dead_letter_topic}")
    assert not asyncio.run(topics(layout.namespace)), "looking made no topic"
    asyncio.run(letters())
    assert args.func(args) == 0
    cap = capsys.readouterr()
    lines = cap.out.splitlines()
    assert len(lines) == 2 and f"{src}[0]@3  9 bytes: not JSON" in lines[0]
    assert f"{src}[0]@4  request r-1 (reply_to {orphan.reply_to}): reply topic" in lines[1]
    assert cap.err.startswith(f"2 dead letters in {layout.dead_letter_topic} (all in the window)")
    args = build_parser().parse_args(["dlq", "--bus", url, "--namespace", layout.namespace, "--json", "--limit", "1"])
    assert args.func(args) == 0
    cap = capsys.readouterr()
    assert [json.loads(x)["reason"] for x in cap.out.splitlines()] == ["not JSON"] and "limit reached" in cap.err
    assert main(["dlq", "--bus", url, "--since", "yesterday-ish"]) == 2
    assert "not a time: 'yesterday-ish'" in capsys.readouterr().err


def test_cluster_ids_never_look_like_options() -> None:
    """A fresh local cluster's id is never taken for a command-line option (1 in 64 random ids
    started with '-', and formatting the cluster then failed)."""
    assert not any(kafka_local._kafka_uuid().startswith("-") for _ in range(5000))


@pytest.mark.kafka
def test_storage_with_a_dash_cluster_id_formats(kafka_bootstrap: str, tmp_path) -> None:
    """A cluster id written before that fix (starting with '-') still formats: it is passed as one
    `--cluster-id=ID` token. (The jars are the session broker's.)"""
    cdir = tmp_path / "cluster"
    cdir.mkdir()
    (cdir / "cluster.id").write_text("-" + kafka_local._kafka_uuid()[1:] + "\n")
    kafka_local._prepare(kafka_local.DEFAULT_DIR / "libs", cdir, 1, 19592)
    assert (cdir / "node-0" / "data" / "meta.properties").is_file()
