"""The edge never splices two attempts of one request, request ids never repeat across edge
processes that share an edge id, and every request on the bus names its seed."""

from __future__ import annotations

import pytest

from bus import Cancel, Finished, SamplingParams, TokenChunk, Usage
from edge.admission.lifecycle import Stream
from edge.admission.router import ReplyRouter, SpliceMismatch, dedupe
from edge.config import EdgeConfig
from edge.metrics import EdgeMetrics
from edge.server import Edge
from tests.edge.conftest import client, collect, recv, running_edge, send, wait_for


def gen(cid: str, n: int, **kw) -> dict:
    return {"type": "generate", "id": cid, "prompt": "hello there", "max_tokens": n, "ignore_eos": True, **kw}


def _stream() -> Stream:
    return Stream("r", "c", None, None, ("m", "p1", "ws"), 3, 10, 0.0, 1.0, False)  # type: ignore[arg-type]  # dedupe reads neither sink nor principal


def test_dedupe_trims_an_equal_overlap_and_refuses_a_different_one() -> None:
    s = _stream()
    assert dedupe(s, TokenChunk("r", 0, 0, (5, 6, 7), "abc", 0)) == (0, "abc", (5, 6, 7), None)
    # attempt 1 re-sends 0..3 with the same first three ids: only seq 3 is new
    assert dedupe(s, TokenChunk("r", 1, 0, (5, 6, 7, 8), "abcd", 0)) == (3, "d", (8,), None)
    assert dedupe(s, TokenChunk("r", 1, 1, (6, 7), "bc", 1)) is None  # all old, equal: a duplicate
    with pytest.raises(SpliceMismatch):
        dedupe(s, TokenChunk("r", 2, 2, (7, 9, 10), "cxy", 2))  # seq 3 was 8, not 9
    assert s.next_seq == 4 and s.delivered == [5, 6, 7, 8]  # a refused chunk changes nothing


async def test_a_diverged_rerun_ends_the_stream_with_a_retryable_error(encoder) -> None:
    async with running_edge(encoder, worker_kw={"replay_after": 6, "diverge_on_replay": True,
                                                "step_s": 0.01}) as (edge, fw):
        async with client(edge) as ws:
            await send(ws, gen("a", 40, token_ids=True))
            acc = await recv(ws)
            text, deltas, final = await collect(ws, "a")
            assert final["type"] == "error" and final["code"] == "internal" and final["retry_after"] == 0
            assert "diverged" in final["message"]
            sent = [t for d in deltas for t in d["token_ids"]]
            assert sent == [i % 200 + 3 for i in range(6)]  # only the first attempt's tokens, never mixed
            await wait_for(lambda: Cancel(acc["request_id"], "diverged") in fw.cancels)
            assert "lockgate:edge_splice_mismatches_total 1.0" in edge.metrics.render().decode()


async def test_a_rerun_with_the_same_tokens_is_spliced_exactly(encoder) -> None:
    async with running_edge(encoder, worker_kw={"replay_after": 6}) as (edge, _fw):
        async with client(edge) as ws:
            await send(ws, gen("a", 15, token_ids=True))
            await recv(ws)
            _, deltas, final = await collect(ws, "a")
            assert final["type"] == "done"
            assert [t for d in deltas for t in d["token_ids"]] == [i % 200 + 3 for i in range(15)]
            assert "lockgate:edge_splice_mismatches_total 0.0" in edge.metrics.render().decode()


async def test_the_accepted_frame_and_the_bus_request_name_the_seed(encoder) -> None:
    async with running_edge(encoder) as (edge, fw):
        async with client(edge) as ws:
            await send(ws, gen("a", 2))
            assigned = await recv(ws)
            await collect(ws, "a")
            await send(ws, gen("b", 2, seed=1234))
            given = await recv(ws)
            await collect(ws, "b")
        assert isinstance(assigned["seed"], int) and 0 <= assigned["seed"] < 2**63
        assert given["seed"] == 1234
        by_id = {r.request_id: r.sampling.seed for r in fw.seen}
        assert by_id == {assigned["request_id"]: assigned["seed"], given["request_id"]: 1234}


def test_seeded_keeps_a_given_seed_and_draws_a_new_one_otherwise() -> None:
    assert SamplingParams(seed=7).seeded().seed == 7
    seeds = {SamplingParams().seeded().seed for _ in range(20)}
    assert len(seeds) == 20 and all(s is not None and 0 <= s < 2**63 for s in seeds)


async def test_two_edges_with_one_edge_id_never_share_a_request_id(encoder) -> None:
    """Two edge processes started with the same ``--edge-id`` (a restart, or ``--reuse-port``):
    a request cancelled on one must not abort the other's, and each answers only its own."""
    async with running_edge(encoder, worker_kw={"step_s": 0.01}, edge_id="same") as (edge_a, fw):
        config = EdgeConfig(model=edge_a.config.model, port=0, keys=edge_a.config.keys, ping_interval_s=None,
                            edge_id="same")
        async with Edge(config, edge_a.bus, encoder) as edge_b:
            await wait_for(lambda: edge_b.readiness()[0])
            async with client(edge_a) as wa, client(edge_b) as wb:
                await send(wa, gen("x", 400))
                x = await recv(wa)
                await send(wa, {"type": "cancel", "id": "x"})
                await collect(wa, "x")
                await wait_for(lambda: any(c.request_id == x["request_id"] for c in fw.cancels))
                results = []
                for i in range(3):
                    await send(wb, gen(f"y{i}", 5))
                    y = await recv(wb)
                    assert y["request_id"] != x["request_id"]
                    results.append(await collect(wb, f"y{i}"))
                assert all(final["type"] == "done" and final["finish_reason"] == "length" for _, _, final in results)
            ids_a = {edge_a.admission.new_request_id() for _ in range(3)}
            ids_b = {edge_b.admission.new_request_id() for _ in range(3)}
            assert ids_a.isdisjoint(ids_b) and all(i.startswith("same-") for i in ids_a | ids_b)


class _Lifecycle:
    """What the router hands on, recorded (the real lifecycle feeds a client)."""

    def __init__(self, stream: Stream) -> None:
        self.streams = {stream.request_id: stream}
        self.deltas: list[tuple[int, tuple[int, ...]]] = []
        self.finished: list[Finished] = []

    def delta(self, stream, seq, text, token_ids, logprobs) -> None:
        self.deltas.append((seq, token_ids))

    def finish(self, stream, msg) -> None:
        self.finished.append(msg)

    def fail(self, *args, **kw) -> None:
        raise AssertionError(f"unexpected failure {args}")


def test_replies_of_a_fenced_attempt_are_dropped_after_a_takeover_replied() -> None:
    """A takeover replies with a higher attempt (docs/worker.md, "Failover"); from its first reply
    on, the paused worker's replies (lower attempt: chunks, even equal ones, and its final) are
    dropped and counted, never spliced."""
    s = _stream()
    life = _Lifecycle(s)
    metrics = EdgeMetrics()
    router = ReplyRouter(None, "t", metrics, life)  # type: ignore[arg-type]  # _route_one reads no bus
    rec = None
    router._route_one(TokenChunk("r", 0, 0, (5, 6), "ab", 0), rec)  # type: ignore[arg-type]
    router._route_one(TokenChunk("r", 1, 2, (7,), "c", 2), rec)  # type: ignore[arg-type]  # the takeover
    router._route_one(TokenChunk("r", 0, 2, (7, 8), "cd", 2), rec)  # type: ignore[arg-type]  # stale: fenced
    router._route_one(Finished("r", 0, "length", 4, Usage(3, 4)), rec)  # type: ignore[arg-type]  # stale final
    router._route_one(TokenChunk("r", 1, 3, (8,), "d", 3), rec)  # type: ignore[arg-type]
    router._route_one(Finished("r", 1, "length", 4, Usage(3, 4)), rec)  # type: ignore[arg-type]
    assert life.deltas == [(0, (5, 6)), (2, (7,)), (3, (8,))]
    assert [f.attempt for f in life.finished] == [1]
    assert "lockgate:edge_fenced_replies_total 2.0" in metrics.render().decode()
