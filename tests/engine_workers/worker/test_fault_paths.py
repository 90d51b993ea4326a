"""The worker's fault paths (issue #22): a failed reply send, a dead-letter topic that cannot be
written, reply records over the producer's size limit, the engine's command queue full, and an
engine crash. Each request is answered or dead-lettered and its partition's committed offset
moves past it; the worker keeps serving. The bus's faults are injected by :class:`FaultyBus` (a
memory bus whose sends to chosen topics fail), the engine's through its public hooks."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from bus import (
    BusError,
    Error,
    Finished,
    InferenceRequest,
    MemoryBus,
    RecordMetadata,
    TokenChunk,
    TopicLayout,
    TopicSpec,
    Usage,
    connect,
    decode,
    parse_dead_letter,
    replies_of,
)
from engine_workers.engine.async_engine import AsyncEngine
from engine_workers.worker.actor import Worker, WorkerConfig
from engine_workers.worker.replies.sender import ReplySender
from lockgate_types import SamplingParams
from tests.engine_workers.worker.test_worker_memory import MODEL, Replies, make_engine, publish, record_submissions, req
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from devtools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def layout() -> TopicLayout:
    return TopicLayout(namespace=f"t{uuid.uuid4().hex[:8]}", partitions=1)  # one partition a tier: one watermark


class FaultyBus(MemoryBus):
    """A memory bus whose sends to a topic fail with ``BusError`` while the topic is in ``down``,
    and for the next ``fail_next[topic]`` sends to it (a broker refusing them, a partition without
    a leader for longer than the producer waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.down: set[str] = set()
        self.fail_next: dict[str, int] = {}
        self.failed: dict[str, int] = {}  # topic -> sends failed so far

    async def send(self, topic: str, value: bytes, key: bytes | None = None, headers: Sequence[tuple[str, bytes]] = (),
                   partition: int | None = None) -> RecordMetadata:
        if topic in self.down or self.fail_next.get(topic, 0) > 0:
            if topic not in self.down:
                self.fail_next[topic] -= 1
            self.failed[topic] = self.failed.get(topic, 0) + 1
            raise BusError(f"injected: {topic} has no leader")
        return await super().send(topic, value, key=key, headers=headers, partition=partition)


def committed(bus: MemoryBus, w: Worker) -> int:
    """Records committed by the worker's group over every partition."""
    return sum(bus.broker.group(w.config.group).committed.values())


async def serving(tiny_dir: Path, layout: TopicLayout, bus: MemoryBus, **config: object) -> Worker:
    w = Worker(WorkerConfig(MODEL, layout=layout, commit_interval_s=0, **config), bus, make_engine(tiny_dir))  # type: ignore[arg-type]  # config overrides by keyword, checked by WorkerConfig
    await w.start()
    return w


async def test_a_send_that_fails_once_is_run_again_and_the_offset_advances(tiny_dir: Path, layout: TopicLayout) -> None:
    """Its replies failed (no retry left): the request runs again from the start, the client gets
    its whole stream, and the partition's committed offset moves past it and the one after it.
    Before: it was dropped with its offset in flight, pinning the partition for the worker's life."""
    async with FaultyBus() as bus:
        w = await serving(tiny_dir, layout, bus, send_retries=0)
        try:
            submitted = record_submissions(w)
            replies = Replies(bus, layout.reply_topic("test"))
            await replies.consumer.start()
            bus.fail_next[layout.reply_topic("test")] = 1
            await publish(bus, layout, req("a", layout, max_tokens=8))
            await publish(bus, layout, req("b", layout, max_tokens=8))
            await replies.wait(["a", "b"], 20)
            for rid in ("a", "b"):
                assert isinstance(replies.final[rid], Finished) and replies.final[rid].num_tokens == 8
                assert len(replies.stream(rid)) == 8  # no gap: the re-run filled what the failed record lost
            assert bus.failed[layout.reply_topic("test")] == 1
            assert submitted.count("a") == 2, submitted  # ran again
            await wait_until(lambda: committed(bus, w) == 2, message=lambda: f"committed {committed(bus, w)}")
            assert w.live()
        finally:
            await w.stop()


async def test_replies_failing_every_run_are_answered_then_dead_lettered(tiny_dir: Path, layout: TopicLayout) -> None:
    """A reply topic that takes nothing: the request runs again (``send_failure_reruns``), then its
    Error fails too, then it is dead-lettered with the reason and committed; after the topic
    recovers the worker answers the next request as ever."""
    topic = layout.reply_topic("test")
    async with FaultyBus() as bus:
        await bus.ensure_topics([TopicSpec(topic, 1)])  # it exists: its sends fail, it is not missing
        w = await serving(tiny_dir, layout, bus, send_retries=0, send_failure_reruns=1)
        try:
            async with bus.consumer([layout.dead_letter_topic], start_from="earliest") as dlq:
                submitted = record_submissions(w)
                bus.down.add(topic)
                await publish(bus, layout, req("doomed", layout, max_tokens=4))
                dead = await wait_until(lambda: dlq.getmany(timeout_ms=100), timeout=15, message="a dead letter")
                letter = parse_dead_letter(dead[0])
                assert letter.reason == f"replies to {topic!r} could not be sent (3 runs)"
                request = decode(letter.value)
                assert isinstance(request, InferenceRequest) and request.request_id == "doomed"
                # two runs (the first and one re-run) and the Error after them: three failed sends
                assert submitted == ["doomed", "doomed"] and bus.failed[topic] == 3
                await wait_until(lambda: committed(bus, w) == 1)
                bus.down.discard(topic)
                replies = Replies(bus, topic)
                await replies.consumer.start()
                await publish(bus, layout, req("later", layout, max_tokens=4))
                await replies.wait(["later"], 10)
                assert "doomed" not in replies.final and isinstance(replies.final["later"], Finished)
                await wait_until(lambda: committed(bus, w) == 2)
                assert w.live()
        finally:
            await w.stop()


async def test_a_dead_letter_topic_outage_never_stops_the_intake(tiny_dir: Path, layout: TopicLayout) -> None:
    """The DLQ topic cannot be written (its leader down) when an undecodable record arrives: the
    requests after it are served, the record's dead letter is retried, the partition's commits
    stop at it (never past a lost letter), and once the DLQ is back it lands and all is committed.
    Before: the failed DLQ send raised out of the intake loop and the worker stopped serving."""
    async with FaultyBus() as bus:
        w = await serving(tiny_dir, layout, bus)
        try:
            replies = Replies(bus, layout.reply_topic("test"))
            await replies.consumer.start()
            bus.down.add(layout.dead_letter_topic)
            await bus.send(layout.request_topic(MODEL, 1), b"{not json", key=b"junk")
            await publish(bus, layout, req("ok1", layout, max_tokens=4))
            await publish(bus, layout, req("ok2", layout, max_tokens=4))
            await replies.wait(["ok1", "ok2"], 20)
            await wait_until(lambda: bus.failed.get(layout.dead_letter_topic, 0) >= 3, message="dead letter retried")
            assert w.live() and committed(bus, w) == 0  # held at the junk record, whose letter is not out yet
            bus.down.discard(layout.dead_letter_topic)
            async with bus.consumer([layout.dead_letter_topic], start_from="earliest") as dlq:
                dead = await wait_until(lambda: dlq.getmany(timeout_ms=100), timeout=10, message="the dead letter")
            assert len(dead) == 1 and dead[0].value == b"{not json"
            await wait_until(lambda: committed(bus, w) == 3, message=lambda: f"committed {committed(bus, w)}")
            assert "lockgate:dead_letters_total 1.0" in w.render_metrics().decode()
        finally:
            await w.stop()


async def test_a_full_engine_command_queue_strands_no_request(tiny_dir: Path, layout: TopicLayout,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The engine's command queue full (a one-command queue and a step loop held by its hook):
    the request that did not fit goes back to the intake instead of being marked admitted with
    no engine request behind it; once the engine moves, every request is answered and committed."""
    gate = threading.Event()
    aengine = AsyncEngine(make_engine(tiny_dir), max_commands=1, before_step=lambda: gate.wait(10))
    async with MemoryBus() as bus:
        w = Worker(WorkerConfig(MODEL, layout=layout, commit_interval_s=0), bus, aengine)
        try:
            await w.start()
            replies = Replies(bus, layout.reply_topic("test"))
            await replies.consumer.start()
            with caplog.at_level(logging.WARNING, logger="engine_workers.worker.pipeline.admission"):
                for i in range(3):
                    await publish(bus, layout, req(f"r{i}", layout, max_tokens=6))
                await wait_until(lambda: "engine command queue full" in caplog.text, message="a submit refused")
            assert w.stages.ledger.in_engine <= 2  # never counts the refused one
            gate.set()
            await replies.wait(["r0", "r1", "r2"], 20)
            assert all(isinstance(replies.final[f"r{i}"], Finished) and replies.final[f"r{i}"].num_tokens == 6
                       for i in range(3))
            await wait_until(lambda: committed(bus, w) == 3)
            await wait_until(lambda: w.stages.ledger.in_engine == 0)
        finally:
            gate.set()
            await w.stop()
            await aengine.stop()


async def test_aborts_never_wait_for_a_full_command_queue(tiny_dir: Path) -> None:
    """Cancels, rebalances and deadlines abort through ``AsyncEngine.abort``: with the command queue
    full (one slot, the step loop held) an abort must neither raise nor be lost."""
    gate = threading.Event()
    finals: dict[str, str | None] = {}
    aengine = AsyncEngine(make_engine(tiny_dir), max_commands=1, before_step=lambda: gate.wait(10),
                          on_outputs=lambda outs: finals.update({o.request_id: o.finish_reason for o in outs
                                                                 if o.finished}))
    await aengine.start()
    try:
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        await asyncio.wrap_future(aengine.submit("a0", [5, 6, 7], params))  # in the engine, its step held
        aengine.submit("filler", [5, 6], params)  # fills the one-command queue
        with pytest.raises(queue.Full):
            aengine.submit("more", [5, 6], params)
        for _ in range(100):
            aengine.abort("a0")  # never raises, the queue being full
        gate.set()
        await wait_until(lambda: "a0" in finals and "filler" in finals, timeout=20)
        assert finals["a0"] == "abort" and finals["filler"] == "length"
    finally:
        gate.set()
        await aengine.stop()


async def test_an_engine_crash_ends_every_stream_after_its_outputs(tiny_dir: Path) -> None:
    """A step-loop crash (raised from the ``before_step`` hook) reaches every open stream, after
    the outputs it already held, including one whose consumer had read nothing; nothing raises on
    the event loop. (A bounded stream's ``put_nowait`` in ``_fail_all`` could raise QueueFull.)"""
    steps = 0

    def crash_at_step_4() -> None:
        nonlocal steps
        steps += 1
        if steps == 4:
            raise RuntimeError("injected crash")

    loop_errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(make_engine(tiny_dir), before_step=crash_at_step_4) as aengine:
        idle = aengine.generate("idle", [5, 6, 7], params)  # read only after the crash
        busy = aengine.generate("busy", [5, 6, 8], params)
        first = asyncio.ensure_future(idle.__anext__())
        got: list[TokenChunk | object] = []
        with pytest.raises(RuntimeError, match="engine crashed"):
            async for out in busy:
                got.append(out)
        held = [await first]
        with pytest.raises(RuntimeError, match="engine crashed"):
            async for out in idle:
                held.append(out)
        assert 1 <= len(got) <= 3 and 1 <= len(held) <= 3  # the outputs before the crash, then the crash
        assert aengine.error is not None
    assert loop_errors == []


@pytest.mark.kafka
async def test_a_reply_batch_over_1mib_is_delivered_whole_split_across_records(kafka_bootstrap: str) -> None:
    """Replies coalesced while the bus lagged (logprobs 20; nine requests of one partition, one of
    them over the limit by itself): sent to real Kafka as several records under the producer's
    1 MiB limit, in order; every request's tokens, text and logprobs arrive whole, its final
    after them. Before: one record over max.request.size, refused on every retry."""
    topic = f"t.{uuid.uuid4().hex[:12]}"
    async with connect(f"kafka://{kafka_bootstrap}?client_id=lockgate-tests") as bus:
        await bus.ensure_topics([TopicSpec(topic, 1)])
        failed: list[str] = []
        acked: list[str] = []
        sender = ReplySender(bus, "w", on_failed=lambda k, _why: failed.append(k))
        top20 = [[(1000 + j, -0.123456789 * (j + 1)) for j in range(20)]]  # one token's top-20 logprobs
        sizes = {"big": 3000, **{f"r{i}": 300 for i in range(8)}}  # ~1.3 MB for "big" alone, ~2.4 MB in all
        offsets = dict.fromkeys(sizes, 0)
        for step in range(max(sizes.values())):  # all queued before the loop yields: one round
            for rid, n in sizes.items():
                if step < n:
                    text = f"<{step}>"
                    sender.chunk(rid, topic, rid, 0, step, (step % 500,), text, offsets[rid], top20)
                    offsets[rid] += len(text)
        for rid, n in sizes.items():
            sender.final(rid, topic, rid, Finished(rid, 0, "length", n, Usage(1, n)),
                         lambda rid=rid: acked.append(rid))
        await wait_until(lambda: len(acked) == len(sizes) or failed, timeout=60, message="every final acknowledged")
        assert failed == [] and sorted(acked) == sorted(sizes)
        assert sender.records_sent >= 3
        got: dict[str, list[TokenChunk | Finished | Error]] = {}
        async with bus.consumer([topic], start_from="earliest") as c:
            async def all_read() -> bool:
                for rec in await c.getmany(timeout_ms=200):
                    assert len(rec.value) <= (1 << 20) - 1024
                    for m in replies_of(decode(rec.value)):
                        assert isinstance(m, (TokenChunk, Finished, Error))
                        got.setdefault(m.request_id, []).append(m)
                return all(isinstance(got.get(rid, [None])[-1], Finished) for rid in sizes)

            await wait_until(all_read, timeout=30, interval=0, message="every final read back")
        for rid, n in sizes.items():
            *chunks, final = got[rid]
            assert isinstance(final, Finished) and all(isinstance(m, TokenChunk) for m in chunks)
            assert [m.seq for m in chunks] == sorted(m.seq for m in chunks) and chunks[0].seq == 0
            assert [t for m in chunks for t in m.token_ids] == [s % 500 for s in range(n)]
            assert "".join(m.text for m in chunks) == "".join(f"<{s}>" for s in range(n))
            assert all(m.text_offset == len("".join(f"<{s}>" for s in range(m.seq))) for m in chunks)
            assert sum(len(m.logprobs or ()) for m in chunks) == n
        assert len(got["big"]) >= 3  # the request over the limit by itself was split too (2+ chunks, a final)
        await sender.stop()


def test_reply_records_split_in_order_under_the_limit_and_reassemble() -> None:
    """The pure split (``reply_split``): under the limit one value, as ever; over it, values each
    under the limit whose messages, read in order, are the round's: chunks contiguous by ``seq``
    and ``text_offset``, logprobs one per token, each final after its request's tokens."""
    from engine_workers.worker.replies.split import Piece, reply_records

    lp = ((7, -0.5), (8, -1.5))

    def piece(rid: str, n: int) -> Piece:
        texts = [f"t{s}" for s in range(n)]
        chunk = TokenChunk(rid, 0, 0, tuple(range(n)), "".join(texts), 0, tuple(lp for _ in range(n)), "w")
        return Piece(chunk, tuple((1, len(t)) for t in texts))

    pieces = [piece("big", 400), piece("a", 10), piece("b", 30),
              Piece(Finished("a", 0, "length", 10, Usage(1, 10))), Piece(Error("b", "expired", "late"))]
    assert len(reply_records(pieces, 1 << 20)) == 1
    values = reply_records(pieces, 4096)
    assert len(values) > 3 and all(len(v) <= 4096 for v in values)
    seen = [m for v in values for m in replies_of(decode(v))]
    for rid, n in (("big", 400), ("a", 10), ("b", 30)):
        chunks = [m for m in seen if isinstance(m, TokenChunk) and m.request_id == rid]
        assert [t for c in chunks for t in c.token_ids] == list(range(n))
        assert all(c.seq == sum(len(d.token_ids) for d in chunks[:i]) for i, c in enumerate(chunks))
        assert all(c.text_offset == len("".join(d.text for d in chunks[:i])) for i, c in enumerate(chunks))
        assert "".join(c.text for c in chunks) == "".join(f"t{s}" for s in range(n))
        assert all(len(c.logprobs or ()) == len(c.token_ids) for c in chunks)
    order = [(m.request_id, type(m).__name__) for m in seen]
    assert order.index(("a", "Finished")) > max(i for i, o in enumerate(order) if o == ("a", "TokenChunk"))
    assert order.index(("b", "Error")) > max(i for i, o in enumerate(order) if o == ("b", "TokenChunk"))
