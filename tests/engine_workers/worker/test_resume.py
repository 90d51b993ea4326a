"""Resume, not restart: a worker that takes over a request continues after the tokens already
published for it (memory bus, tiny model; the kill -9 case on real Kafka is in
test_worker_kafka.py)."""

from __future__ import annotations

import time
from pathlib import Path

from bus import Error, Finished, MemoryBus, ReplyBatch, SamplingParams, TokenChunk, TopicLayout, Usage, encode, partition_for_key
from engine_workers.worker.actor import Worker, WorkerConfig
from engine_workers.worker.pipeline.resume import Progress, decode_replies, fold_progress
from tests.engine_workers.worker.test_worker_memory import MODEL, Replies, layout, make_engine, publish, req, tiny_dir  # noqa: F401 - pytest fixtures, used by name
from tests.waiting import wait_until


def test_fold_keeps_the_contiguous_prefix_and_the_final_reply() -> None:
    replies = [
        TokenChunk("a", 0, 0, (1, 2), "", 0),
        TokenChunk("b", 0, 0, (9,), "", 0),
        TokenChunk("a", 1, 1, (2, 3, 4), "", 0),  # a re-run overlapping: only seq 3.. is new
        TokenChunk("a", 1, 7, (8,), "", 0),  # past a gap (seq 4..6 missing): left out
        TokenChunk("c", 0, 2, (5,), "", 0),  # no seq 0: nothing contiguous
        Finished("b", 0, "length", 1, Usage(3, 1)),
        Error("d", "expired", "late"),
        TokenChunk("zzz", 0, 0, (7,), "", 0),  # not asked for
    ]
    got = fold_progress({"a", "b", "c", "d", "e"}, replies)
    # attempt: the highest any of its replies carried (a takeover replies above it: fencing)
    assert got == {"a": Progress((1, 2, 3, 4), None, 1), "b": Progress((9,), replies[5], 0), "c": Progress((), None, 0),
                   "d": Progress((), replies[6], 0)}
    batch = encode(ReplyBatch((TokenChunk("a", 0, 0, (1,), "", 0),), (Finished("a", 0, "stop", 1, Usage(1, 1)),)))
    assert [type(m).__name__ for m in decode_replies([b"not json", batch])] == ["TokenChunk", "Finished"]


def test_fold_leaves_out_fenced_replies_as_the_edge_does() -> None:
    """A paused worker (attempt 0) comes back after a takeover (attempt 1) and publishes tokens past
    the taker's and its final reply: the edge dropped them, so a third run must resume where the
    taker was (no gap in the client's stream) and the request is not answered."""
    replies = [
        TokenChunk("p", 0, 0, (1, 2), "", 0, None, "paused"),
        TokenChunk("p", 1, 2, (3,), "", 0, None, "taker"),  # the takeover, from seq 2
        TokenChunk("p", 0, 2, (3, 4, 5, 6), "", 0, None, "paused"),  # queued before the pause: fenced
        Finished("p", 0, "length", 7, Usage(3, 7), worker_id="paused"),  # fenced too
        TokenChunk("p", 1, 3, (4,), "", 0, None, "taker"),
        Error("q", "internal", "boom", attempt=0),
        TokenChunk("q", 2, 0, (7,), "", 0),  # a higher attempt after an error: the edge ended it at the error
    ]
    got = fold_progress({"p", "q"}, replies)
    assert got["p"] == Progress((1, 2, 3, 4), None, 1)
    assert got["q"].final == replies[5]


def _sampled(rid: str, layout: TopicLayout, max_tokens: int, seed: int, enqueued_at: float):
    r = req(rid, layout, prompt=(3, 4, 5, 6, 7), max_tokens=max_tokens)
    return type(r)(r.request_id, r.model, r.prompt_token_ids,
                   SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed, ignore_eos=True),
                   r.reply_to, enqueued_at=enqueued_at)


async def _history(bus, layout: TopicLayout, rid: str, token_ids: list[int], final: Finished | None = None) -> None:
    """What a worker that died had published for ``rid``: its first tokens (one chunk each, as
    steps), maybe its final reply, on the partition the request id keys to."""
    topic = layout.reply_topic("test")
    part = partition_for_key(rid.encode(), layout.partitions)
    for i, t in enumerate(token_ids):
        await bus.send(topic, encode(TokenChunk(rid, 0, i, (t,), "", 0, None, "dead")), partition=part)
    if final is not None:
        await bus.send(topic, encode(final), partition=part)


async def test_a_taken_over_request_continues_after_its_published_tokens(tiny_dir: Path, layout: TopicLayout) -> None:
    engine = make_engine(tiny_dir)
    n, k = 24, 9
    requests = [_sampled(f"s{i}", layout, n, seed=1000 + i, enqueued_at=time.time() - 5) for i in range(3)]
    refs = [engine.generate([r.prompt_token_ids], [r.sampling])[0].token_ids for r in requests]
    async with MemoryBus() as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test")])
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        for r, ref in zip(requests[:2], refs):
            await _history(bus, layout, r.request_id, list(ref[:k]))  # s2 has no history: a fresh start
        for r in requests:
            await publish(bus, layout, r)
        async with Worker(WorkerConfig(MODEL, layout=layout, heartbeat_s=0.1), bus, engine) as w:
            await replies.wait([r.request_id for r in requests])
            for r, ref in zip(requests, refs):
                assert replies.stream(r.request_id) == list(ref), r.request_id  # history + continuation
                fin = replies.final[r.request_id]
                assert isinstance(fin, Finished) and fin.num_tokens == n
            mine = [c for c in replies.chunks if c.worker_id == w.config.worker_id]
            # the resumed requests were never generated again before k: no decode step re-run
            assert min(c.seq for c in mine if c.request_id == "s0") == k
            assert min(c.seq for c in mine if c.request_id == "s1") == k
            assert min(c.seq for c in mine if c.request_id == "s2") == 0
            m = w.render_metrics().decode()
            assert "lockgate:resumed_requests_total 2.0" in m and f"lockgate:resumed_tokens_total {2.0 * k}" in m


async def test_a_request_answered_before_the_takeover_is_committed_without_running(tiny_dir: Path,
                                                                                    layout: TopicLayout) -> None:
    engine = make_engine(tiny_dir)
    r = _sampled("done", layout, 4, seed=7, enqueued_at=time.time() - 5)
    async with MemoryBus() as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test")])
        await _history(bus, layout, "done", [11, 12, 13, 14], Finished("done", 0, "length", 4, Usage(5, 4)))
        await publish(bus, layout, r)
        async with Worker(WorkerConfig(MODEL, layout=layout, commit_interval_s=0), bus, engine) as w:
            tp_topic = layout.request_topic(MODEL, r.tier)
            group = bus.broker.group(w.config.group)
            await wait_until(lambda: sum(group.committed.get(tp, 0) for tp in group.committed
                                         if tp.topic == tp_topic) == 1)
            assert w.aengine.snapshot.steps == 0  # never ran
            assert "lockgate:answered_before_takeover_total 1.0" in w.render_metrics().decode()


async def test_a_request_sent_after_the_assignment_is_not_looked_up(tiny_dir: Path, layout: TopicLayout) -> None:
    engine = make_engine(tiny_dir)
    async with MemoryBus() as bus:
        async with Worker(WorkerConfig(MODEL, layout=layout), bus, engine) as w:
            await wait_until(lambda: w.stages.ledger.assigned_at)
            replies = Replies(bus, layout.reply_topic("test"))
            await bus.ensure_topics([layout.reply_spec("test")])
            await replies.consumer.start()
            late = _sampled("late", layout, 3, seed=1, enqueued_at=time.time() + 10)  # well after the assignment
            await _history(bus, layout, "late", [1, 2])  # would be resumed if it were looked up
            await publish(bus, layout, late)
            await replies.wait(["late"])
            assert min(c.seq for c in replies.chunks if c.worker_id == w.config.worker_id) == 0
            assert "lockgate:resumed_requests_total 0.0" in w.render_metrics().decode()


async def test_taken_over_embedding_requests_run_again_or_are_answered(tiny_dir: Path, layout: TopicLayout) -> None:
    """An embedding request a dead worker never answered (it publishes no chunks, so there is nothing
    to resume after) runs from its prompt on the worker that takes it over, its vector the engine's
    own, for both poolings; one it had answered is committed without running again."""
    engine = make_engine(tiny_dir)
    prompt = tuple(range(3, 40))

    def embedding(rid: str, pooling: str):
        r = req(rid, layout, prompt=prompt, max_tokens=1)
        return type(r)(r.request_id, r.model, r.prompt_token_ids, SamplingParams(max_tokens=1, temperature=0.0,
                       pooling=pooling), r.reply_to, enqueued_at=time.time() - 5)

    wanted = {}
    for pooling in ("last", "mean"):
        engine.add_request(f"ref-{pooling}", list(prompt), embedding("x", pooling).sampling)
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    wanted[pooling] = o.embedding
    async with MemoryBus() as bus:
        await bus.ensure_topics(layout.model_specs(MODEL) + [layout.reply_spec("test")])
        replies = Replies(bus, layout.reply_topic("test"))
        await replies.consumer.start()
        await _history(bus, layout, "answered", [], Finished("answered", 0, "stop", 0, Usage(len(prompt), 0),
                                                             embedding=wanted["mean"]))
        for rid, pooling in (("e-last", "last"), ("e-mean", "mean"), ("answered", "mean")):
            await publish(bus, layout, embedding(rid, pooling))
        async with Worker(WorkerConfig(MODEL, layout=layout, heartbeat_s=0.1), bus, engine) as w:
            await replies.wait(["e-last", "e-mean"])
            for rid, pooling in (("e-last", "last"), ("e-mean", "mean")):
                fin = replies.final[rid]
                assert isinstance(fin, Finished) and fin.embedding is not None, fin
                assert max(abs(a - b) for a, b in zip(fin.embedding, wanted[pooling], strict=True)) < 1e-5
            await wait_until(lambda: "lockgate:answered_before_takeover_total 1.0" in w.render_metrics().decode())
            await replies.poll(100)
            assert [f.request_id for f in replies.finals].count("answered") == 1  # only the dead worker's
