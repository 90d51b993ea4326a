"""The worker over the in-memory bus with the tiny model: streams, cancel, errors, heartbeat, drain."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from bus import (
    Cancel,
    Error,
    Finished,
    InferenceRequest,
    MemoryBus,
    SamplingParams,
    TokenChunk,
    TopicLayout,
    TopicPartition,
    WorkerStatus,
    decode,
    encode,
    replies_of,
)
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.worker.actor import Worker, WorkerConfig
from tests.waiting import wait_until

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from devtools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


def make_engine(path: Path, max_num_seqs: int = 4) -> Engine:
    return Engine(EngineConfig(model=str(path), max_num_seqs=max_num_seqs, num_threads=1, kv_cache_bytes=4 << 20,
                               max_model_len=512))


@pytest.fixture
def layout() -> TopicLayout:
    return TopicLayout(namespace=f"t{uuid.uuid4().hex[:8]}", partitions=2)


def req(rid: str, layout: TopicLayout, prompt=(5, 6, 7, 8), max_tokens=12, tier=1, **kw) -> InferenceRequest:
    return InferenceRequest(rid, kw.pop("model", MODEL), tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            ignore_eos=True), layout.reply_topic("test"), tier=tier, enqueued_at=time.time(), **kw)


async def publish(bus, layout: TopicLayout, r: InferenceRequest) -> None:
    await bus.send(layout.request_topic(MODEL, r.tier), encode(r), key=r.request_id.encode())


class Replies:
    """Reads a reply topic from the beginning, reassembling streams by (request id, seq)."""

    def __init__(self, bus, topic: str) -> None:
        self.consumer = bus.consumer([topic], start_from="earliest")
        self.tokens: dict[str, dict[int, int]] = {}
        self.final: dict[str, Finished | Error] = {}  # the latest final reply per request
        self.finals: list[Finished | Error] = []  # every final reply, in arrival order (re-runs too)
        self.chunks: list[TokenChunk] = []
        self.messages: list[TokenChunk | Finished | Error] = []  # every reply, in topic order

    async def wait(self, ids, timeout: float = 30.0) -> None:
        """Read until every request in ``ids`` has its final reply."""
        async def arrived() -> bool:
            if set(ids) <= set(self.final):
                return True
            await self.poll(100)
            return False

        await wait_until(arrived, timeout=timeout, interval=0,
                         message=lambda: f"missing replies: {set(ids) - set(self.final)}")

    async def wait_streaming(self, timeout: float, why: str, poll_ms: int = 50) -> None:
        """Wait until some token chunk has arrived; ``why`` is the failure message."""
        async def streaming() -> bool:
            if self.chunks:
                return True
            await self.poll(poll_ms)
            return False

        await wait_until(streaming, timeout=timeout, interval=0, message=why)

    async def poll(self, timeout_ms: int) -> None:
        for rec in await self.consumer.getmany(timeout_ms=timeout_ms):
            for msg in replies_of(decode(rec.value)):
                if isinstance(msg, (TokenChunk, Finished, Error)):
                    self.messages.append(msg)
                if isinstance(msg, TokenChunk):
                    self.chunks.append(msg)
                    for i, t in enumerate(msg.token_ids):
                        self.tokens.setdefault(msg.request_id, {})[msg.seq + i] = t
                elif isinstance(msg, (Finished, Error)):
                    self.final[msg.request_id] = msg
                    self.finals.append(msg)

    def stream(self, rid: str) -> list[int]:
        got = self.tokens.get(rid, {})
        assert sorted(got) == list(range(len(got))), "gap in seq"
        return [got[i] for i in range(len(got))]


async def test_streams_match_reference_and_commit(tiny_dir: Path, layout: TopicLayout,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engine_workers.worker.offsets.ledger")
    engine = make_engine(tiny_dir)
    prompts = [tuple(range(3 + i, 20 + 3 * i)) for i in range(6)]
    ref = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    async with MemoryBus() as bus, Worker(WorkerConfig(MODEL, layout=layout, heartbeat_s=0.1, commit_interval_s=0), bus,
                                                        engine) as w:
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        reqs = [req(f"r{i}", layout, p, tier=i % 3) for i, p in enumerate(prompts)]
        for r in reqs:
            await publish(bus, layout, r)
        await replies.wait([r.request_id for r in reqs])
        # the assignment is logged, naming every partition it reads
        assigned = [r.getMessage() for r in caplog.records if "assigned" in r.getMessage()]
        assert assigned and all(f"{t}[{p}]" in assigned[-1] for t in layout.request_topics(MODEL)
                                for p in range(layout.partitions))
        for r, expected in zip(reqs, ref):
            assert replies.stream(r.request_id) == list(expected.token_ids)
            fin = replies.final[r.request_id]
            assert isinstance(fin, Finished) and fin.finish_reason == "length" and fin.num_tokens == 12
            assert fin.usage.prompt_tokens == len(r.prompt_token_ids) and fin.worker_id == w.config.worker_id
            t = fin.timings
            assert 0 <= t.queue <= t.ttft <= t.e2e < 30 and t.tpot >= 0
        # every chunk carries the attempt; text offsets are contiguous
        assert all(c.attempt == 0 for c in replies.chunks)
        group = bus.broker.group(w.config.group)
        ends = {TopicPartition(t, p): bus.broker.topics[t].partitions[p].end
                for t in layout.request_topics(MODEL) for p in range(2)}
        # commit_interval_s=0: the intake loop commits within a poll of the last acknowledgement
        await wait_until(lambda: {tp: group.committed.get(tp, 0) for tp in ends} == ends)
        assert {tp: group.committed.get(tp, 0) for tp in ends} == ends
        m = w.render_metrics().decode()
        assert 'lockgate:request_success_total{finished_reason="length",model="tiny"' in m
        assert "lockgate:time_to_first_token_seconds_bucket" in m and "lockgate:kv_cache_usage_perc" in m


async def test_cancel_frees_kv_within_a_step(tiny_dir: Path, layout: TopicLayout) -> None:
    """A Cancel aborts a running request within a step or two of reaching the worker and frees its
    KV, and answers a queued one without running it. Each step takes >= 20 ms here (a sleep, which
    releases the GIL): the tiny model's own steps take ~1 ms, so on a busy host the event loop could
    wait out several of them for the GIL before it read the Cancel (CI once counted 7)."""
    engine = make_engine(tiny_dir, max_num_seqs=1)
    total = engine.kv.num_blocks
    # the step pacing is the test's input (a slow model), not synchronisation
    async with MemoryBus() as bus, Worker(WorkerConfig(MODEL, layout=layout), bus, engine,
                                          before_step=lambda: time.sleep(0.02)) as w:
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        await publish(bus, layout, req("long", layout, prompt=tuple(range(3, 200)), max_tokens=300))
        await publish(bus, layout, req("queued", layout, max_tokens=5))  # waits in the intake (1 slot)
        # "long" is running, "queued" in the intake
        await wait_until(lambda: w.aengine.snapshot.generated_tokens, timeout=20)
        assert engine.kv.num_free_blocks < total
        steps = w.aengine.snapshot.steps
        await bus.send(layout.control_topic, encode(Cancel("queued")))
        await bus.send(layout.control_topic, encode(Cancel("long")))
        await replies.wait(["long", "queued"], 10)
        assert replies.final["long"].finish_reason == "abort" and replies.final["queued"].finish_reason == "abort"
        assert replies.final["queued"].num_tokens == 0
        assert engine.kv.num_free_blocks == total  # freed by the abort itself
        assert w.aengine.snapshot.steps - steps <= 2
        # the worker keeps serving
        await publish(bus, layout, req("after", layout, max_tokens=3))
        await replies.wait(["after"], 10)
        assert replies.final["after"].num_tokens == 3


def record_submissions(w: Worker) -> list[str]:
    """The request ids ``w`` hands to its engine from now on, in order (a list kept up to date)."""
    submitted: list[str] = []
    submit = w.aengine.submit

    def recording(eid, *args, **kwargs):
        submitted.append(eid.split("#")[0])
        return submit(eid, *args, **kwargs)

    w.aengine.submit = recording
    return submitted


@contextlib.asynccontextmanager
async def serving_with_dlq(tiny_dir: Path, layout: TopicLayout, engine: Engine | None = None, *,
                           before_step: Callable[[], None] | None = None):
    """A worker (on ``engine``, else a fresh one; ``before_step`` its step hook) committing after
    every poll on a fresh memory bus, a reader of the ``test`` reply topic and one of the
    dead-letter topic: yields (bus, worker, replies, dlq)."""
    engine = engine or make_engine(tiny_dir)
    async with MemoryBus() as bus, Worker(WorkerConfig(MODEL, layout=layout, commit_interval_s=0), bus, engine,
                                          before_step=before_step) as w:
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        async with bus.consumer([layout.dead_letter_topic], start_from="earliest") as dlq:
            yield bus, w, replies, dlq


async def test_expired_invalid_and_undecodable(tiny_dir: Path, layout: TopicLayout) -> None:
    async with serving_with_dlq(tiny_dir, layout) as (bus, w, replies, dlq):
        await bus.send(layout.request_topic(MODEL, 1), b"{not json", key=b"junk")
        await publish(bus, layout, req("late", layout, deadline=time.time() - 1))
        await publish(bus, layout, req("long", layout, prompt=tuple(3 + i % 400 for i in range(600))))
        await publish(bus, layout, req("vocab", layout, prompt=(5, 10**6)))
        await publish(bus, layout, req("other", layout, model="other-model"))
        await publish(bus, layout, req("ok", layout, max_tokens=4))
        await replies.wait(["late", "long", "vocab", "other", "ok"], 20)
        f = replies.final
        assert isinstance(f["late"], Error) and f["late"].code == "expired"
        assert isinstance(f["long"], Error) and f["long"].code == "invalid_request" and "context limit" in f["long"].message
        assert isinstance(f["vocab"], Error) and "vocabulary" in f["vocab"].message
        assert isinstance(f["other"], Error) and f["other"].code == "invalid_request"
        assert isinstance(f["ok"], Finished) and f["ok"].num_tokens == 4
        assert "late" not in replies.tokens
        dead = await dlq.getmany(timeout_ms=1000)
        assert len(dead) == 1 and dead[0].value == b"{not json"
        group = bus.broker.group(w.config.group)
        await wait_until(lambda: sum(group.committed.values()) == 6)
        assert sum(group.committed.values()) == 6  # committed past every record, junk included


async def test_running_request_past_its_deadline_is_stopped(tiny_dir: Path, layout: TopicLayout) -> None:
    """A request still running at its deadline is aborted and answered Error(expired) after the
    tokens it had (a requester that died without a Cancel, e.g. a crashed edge, would otherwise
    keep a sequence busy to max_tokens); its KV is freed; one without a deadline runs to the end."""
    engine = make_engine(tiny_dir)

    def slow_step() -> None:  # the test's input, not synchronisation: 300 tokens take >= 6 s, the deadline is 1 s away
        time.sleep(0.02)

    async with serving_with_dlq(tiny_dir, layout, engine, before_step=slow_step) as (bus, w, replies, _):
        await publish(bus, layout, req("late", layout, max_tokens=300, deadline=time.time() + 1.0))
        await publish(bus, layout, req("free", layout, max_tokens=60))
        await replies.wait(["late", "free"], 30)
        late, free = replies.final["late"], replies.final["free"]
        assert isinstance(late, Error) and late.code == "expired" and "while running" in late.message, late
        got = len(replies.stream("late"))
        assert 0 < got < 300 and f"after {got} tokens" in late.message
        assert isinstance(free, Finished) and free.num_tokens == 60
        await wait_until(lambda: engine.kv.num_free_blocks == engine.kv.num_blocks, interval=0.02)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks and w.stages.ledger.in_engine == 0


async def test_missing_reply_topic_is_dead_lettered_and_committed(tiny_dir: Path, layout: TopicLayout) -> None:
    """A request naming a reply topic that does not exist can be answered by no worker: it is
    dead-lettered with the reason (before it runs: the worker checks a new reply topic first) and
    its offset committed (left in flight, it pinned its partition's commits: every later request
    there would run again after any restart). The requests around it are served."""
    from bus import parse_dead_letter

    async with serving_with_dlq(tiny_dir, layout) as (bus, w, replies, dlq):
        gone = layout.reply_topic("gone")
        await publish(bus, layout, req("before", layout, max_tokens=4))
        await publish(bus, layout, dataclasses.replace(req("orphan", layout, max_tokens=200), reply_to=gone))
        await publish(bus, layout, req("after", layout, max_tokens=4))
        await replies.wait(["before", "after"], 20)
        dead = await wait_until(lambda: dlq.getmany(timeout_ms=200), timeout=10, message="a dead letter")
        assert len(dead) == 1, "one dead letter: the orphan"
        letter = parse_dead_letter(dead[0])
        assert letter.reason == f"reply topic {gone!r} does not exist"
        assert letter.source_topic == layout.request_topic(MODEL, 1)
        orphan = decode(letter.value)
        assert isinstance(orphan, InferenceRequest) and orphan.request_id == "orphan" and orphan.reply_to == gone
        assert "orphan" not in replies.final
        await wait_until(lambda: not (w.stages.ledger.in_engine or w.aengine.snapshot.running), interval=0.02)
        assert w.stages.ledger.in_engine == 0 and w.aengine.snapshot.running == 0
        group = bus.broker.group(w.config.group)
        await wait_until(lambda: sum(group.committed.values()) == 3)
        assert sum(group.committed.values()) == 3  # committed past all three, the orphan included
        assert "lockgate:dead_letters_total 1.0" in w.render_metrics().decode()


async def test_requests_to_a_missing_reply_topic_are_dead_lettered_before_they_run(
        tiny_dir: Path, layout: TopicLayout) -> None:
    """Requests naming a missing reply topic (the first one, and a misdirected flood after it) are
    dead-lettered at intake and never reach the engine; a request sent after the topic was
    created runs and is answered (the memory of a missing topic is checked against the bus)."""
    from bus import TopicSpec, parse_dead_letter

    async with serving_with_dlq(tiny_dir, layout) as (bus, w, replies, dlq):
        submitted = record_submissions(w)
        gone = layout.reply_topic("gone")
        await publish(bus, layout, dataclasses.replace(req("o0", layout, max_tokens=50), reply_to=gone))
        dead: list = []

        async def dead_letters(n: int) -> bool:
            dead.extend(await dlq.getmany(timeout_ms=100))
            return len(dead) >= n

        await wait_until(lambda: dead_letters(1), timeout=10)
        assert submitted == [] and len(dead) == 1  # the first one too: its topic is checked before it runs
        for i in (1, 2, 3):
            await publish(bus, layout, dataclasses.replace(req(f"o{i}", layout, max_tokens=50), reply_to=gone))
        await wait_until(lambda: dead_letters(4), timeout=10)
        assert sorted(decode(parse_dead_letter(r).value).request_id for r in dead) == ["o0", "o1", "o2", "o3"]
        assert submitted == [], "none reached the engine"
        await bus.ensure_topics([TopicSpec(gone, 1)])  # the requester made its topic after all
        late = Replies(bus, gone)
        await late.consumer.start()
        await publish(bus, layout, dataclasses.replace(req("o4", layout, max_tokens=5), reply_to=gone))
        await late.wait(["o4"], 10)
        assert isinstance(late.final["o4"], Finished) and submitted == ["o4"]


async def test_a_request_held_for_its_reply_topic_check_can_be_cancelled(tiny_dir: Path, layout: TopicLayout,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The first request naming a reply topic waits for the topic's check; a Cancel arriving
    meanwhile answers it ``abort`` without running it, and the next request to that topic (now
    known) runs without a check."""
    async with serving_with_dlq(tiny_dir, layout) as (bus, w, replies, _):
        real, asked = bus.partitions_for, []

        async def slow(topic: str) -> list[int]:
            asked.append(topic)
            await asyncio.sleep(0.5)  # a slow metadata request (the fake's behaviour): the Cancel lands meanwhile
            return await real(topic)

        monkeypatch.setattr(bus, "partitions_for", slow)
        steps = w.aengine.snapshot.steps
        await publish(bus, layout, req("held", layout, max_tokens=50))
        await wait_until(lambda: len(w.stages.pipeline.gate))
        assert len(w.stages.pipeline.gate) == 1 and w.stages.ledger.in_engine == 0  # held, not queued
        w.cancel("held")
        await replies.wait(["held"], 10)
        assert isinstance(replies.final["held"], Finished) and replies.final["held"].num_tokens == 0
        assert w.aengine.snapshot.steps == steps  # never ran
        await publish(bus, layout, req("next", layout, max_tokens=3))
        await replies.wait(["next"], 10)
        assert replies.final["next"].num_tokens == 3 and asked == [layout.reply_topic("test")]


async def test_heartbeat_health_and_metrics(tiny_dir: Path, layout: TopicLayout) -> None:
    engine = make_engine(tiny_dir)
    cfg = WorkerConfig(MODEL, layout=layout, heartbeat_s=0.05, metrics_port=0)
    async with MemoryBus() as bus:
        status = bus.consumer([layout.status_topic], start_from="earliest")
        async with Worker(cfg, bus, engine) as w:
            await status.start()
            beats = []

            async def three_beats() -> bool:
                beats.extend(decode(r.value) for r in await status.getmany(timeout_ms=100))
                return len(beats) >= 3

            await wait_until(three_beats)
            assert len(beats) >= 3 and all(isinstance(b, WorkerStatus) for b in beats)
            b = beats[-1]
            assert b.worker_id == cfg.worker_id and b.max_num_seqs == 4 and b.kv_blocks_total == engine.kv.num_blocks
            assert len(b.queue_depth) == 3 and not b.draining
            port = w._health.port

            def get(path: str) -> tuple[int, str]:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
                        return resp.status, resp.read().decode()
                except urllib.error.HTTPError as e:
                    return e.code, ""

            assert (await asyncio.to_thread(get, "/healthz"))[0] == 200
            assert (await asyncio.to_thread(get, "/readyz"))[0] == 200
            code, body = await asyncio.to_thread(get, "/metrics")
            assert code == 200 and "lockgate:num_requests_running" in body and "lockgate:prompt_tokens_total" in body
            assert (await asyncio.to_thread(get, "/nope"))[0] == 404


async def test_drain_finishes_running_and_leaves_queue_uncommitted(tiny_dir: Path, layout: TopicLayout) -> None:
    engine = make_engine(tiny_dir, max_num_seqs=1)
    layout1 = TopicLayout(namespace=layout.namespace, partitions=1)
    async with MemoryBus() as bus:
        w = Worker(WorkerConfig(MODEL, layout=layout1), bus, engine)
        await w.start()
        replies = Replies(bus, layout1.reply_topic("test"))
        await replies.consumer.start()
        await publish(bus, layout1, req("a", layout1, max_tokens=40, tier=0))
        await publish(bus, layout1, req("b", layout1, max_tokens=40, tier=0))
        await wait_until(lambda: w.aengine.snapshot.generated_tokens, timeout=10)
        assert await w.drain(grace_s=20)
        await replies.wait(["a"], 5)
        assert replies.final["a"].num_tokens == 40 and "b" not in replies.final
        committed = bus.broker.group(w.config.group).committed
        assert committed == {TopicPartition(layout1.request_topic(MODEL, 0), 0): 1}  # b stays for others
        assert w.state == "stopped"


@pytest.mark.parametrize("end", ["drain", "stop"])
async def test_commits_wait_for_the_interval_and_the_end_commits_at_once(tiny_dir: Path, layout: TopicLayout,
                                                                        end: str) -> None:
    engine = make_engine(tiny_dir)
    async with MemoryBus() as bus:
        w = Worker(WorkerConfig(MODEL, layout=layout, commit_interval_s=60), bus, engine)
        await w.start()
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        reqs = [req(f"r{i}", layout, max_tokens=4) for i in range(4)]
        for r in reqs:
            await publish(bus, layout, r)
        await replies.wait([r.request_id for r in reqs])
        # Not synchronisation: time passing is the input. For six intake polls (POLL_MS = 50) the
        # worker must not commit inside its 60 s interval; no event marks "a poll did not commit".
        await asyncio.sleep(0.3)
        group = bus.broker.group(w.config.group)
        assert group.committed == {}
        if end == "drain":
            assert await w.drain(grace_s=5)
        else:
            await w.stop()  # a plain stop commits what is finished too
        ends = {TopicPartition(t, p): bus.broker.topics[t].partitions[p].end
                for t in layout.request_topics(MODEL) for p in range(layout.partitions)}
        assert {tp: group.committed.get(tp, 0) for tp in ends} == ends and sum(ends.values()) == len(reqs)


async def test_a_failing_reply_topic_check_lets_the_request_run(tiny_dir: Path, layout: TopicLayout,
                                                                monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """An unexpected error while checking a reply topic is logged and the request runs (the reply
    rounds check the topic again), never held for good."""
    async with serving_with_dlq(tiny_dir, layout) as (bus, w, replies, _):
        async def broken(topic: str) -> str | None:
            raise RuntimeError("metadata parser bug")

        monkeypatch.setattr(w.stages.way_back.sender, "verify", broken)
        with caplog.at_level(logging.ERROR, logger="engine_workers.worker.pipeline.gate"):
            await publish(bus, layout, req("r", layout, max_tokens=3))
            await replies.wait(["r"], 10)
        assert replies.final["r"].num_tokens == 3
        assert any("metadata parser bug" in (r.exc_text or "") for r in caplog.records)
