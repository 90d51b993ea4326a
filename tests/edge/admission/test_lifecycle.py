"""The stream lifecycle (edge/admission/lifecycle.py): every stream is released exactly once, by
whichever end comes first (finished, failed, cancelled by its client, its handler leaving or being
cancelled, a slow sink, the deadline), with the counts and refunds that end calls for, and its
sink hears of it exactly once."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus import ErrorCode, Finished, TokenChunk, Usage
from edge.admission.auth import Principal
from edge.admission.lifecycle import Cancelled, Done, End, Failed, Lifecycle, OwnedStreams, Stream
from edge.admission.ratelimit import RateLimiter
from edge.admission.router import ReplyRouter
from edge.config import KeyEntry, hash_key
from edge.metrics import EdgeMetrics

ENTRY = KeyEntry(hash_key("lg-lifecycle-test"), "acme", 1, requests_per_min=1000, tokens_per_min=6000, max_streams=8)
LABELS = ("m", "p1", "openai")
PROMPT, MAX_TOKENS = 4, 10


class Sink:
    """Records what the lifecycle hands it; ``take`` is how many more deltas it accepts."""

    def __init__(self, take: int = 1 << 30) -> None:
        self.deltas: list[tuple[int, str, tuple[int, ...]]] = []
        self.ends: list[End] = []
        self.take = take

    def on_delta(self, s: Stream, seq: int, text: str, token_ids: tuple[int, ...], logprobs: tuple | None) -> bool:
        assert not s.ended and not self.ends, "a delta after the end"
        self.deltas.append((seq, text, token_ids))
        self.take -= 1
        return self.take >= 0

    def on_end(self, s: Stream, end: End) -> None:
        assert s.ended, "the sink hears of the end after the release"
        self.ends.append(end)


class World:
    def __init__(self) -> None:
        self.metrics = EdgeMetrics()
        self.limiter = RateLimiter()
        self.cancels: list[tuple[str, str]] = []
        self.lifecycle = Lifecycle(self.metrics, self.limiter, lambda rid, why: self.cancels.append((rid, why)))
        self._n = 0

    def open(self, owner: OwnedStreams, sink: Sink | None = None, deadline: float = 1e12) -> tuple[Stream, Sink]:
        """A stream as admission opens one: charged, registered, owned."""
        sink = sink if sink is not None else Sink()
        assert self.limiter.admit(ENTRY, PROMPT + MAX_TOKENS, time.monotonic()) is None  # the lifecycle's clock
        self._n += 1
        now = asyncio.get_running_loop().time()
        s = Stream(f"r{self._n}", f"c{self._n}", sink, Principal(ENTRY), LABELS, PROMPT, MAX_TOKENS, now, deadline, False)
        self.lifecycle.register(s, owner)
        return s, sink

    def value(self, name: str, **labels: str) -> float:
        self.metrics.flush_generated()
        v = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    def in_flight(self) -> float:
        return self.value("lockgate:edge_streams")

    def key_streams(self) -> int:
        return self.limiter.limiter(ENTRY, 0.0).streams

    def key_tokens(self) -> float:
        return self.limiter.limiter(ENTRY, 0.0).tokens.level


def finished(s: Stream, reason: str = "stop", n: int = 2) -> Finished:
    return Finished(s.request_id, 0, reason, n, Usage(PROMPT, n, 1))


def ok(reason: str) -> dict[str, str]:
    return {"model": "m", "tier": "p1", "api": "openai", "finished_reason": reason}


async def test_a_finished_stream_is_counted_and_released_once() -> None:
    w = World()
    with OwnedStreams(w.lifecycle) as owned:
        s, sink = w.open(owned)
        before = w.key_tokens()
        assert w.in_flight() == 1 and w.key_streams() == 1
        w.lifecycle.delta(s, 0, "ab", (1, 2), None)
        s.next_seq = 2  # what the router's dedupe advances
        assert w.lifecycle.finish(s, finished(s))
        assert not w.lifecycle.finish(s, finished(s)) and not w.lifecycle.cancel(s, "client")
        assert not w.lifecycle.fail(s, ErrorCode.INTERNAL, "late")
    assert sink.deltas == [(0, "ab", (1, 2))]
    assert len(sink.ends) == 1
    done = sink.ends[0]
    assert isinstance(done, Done) and (done.finish_reason, done.completion_tokens, done.cached_tokens) == ("stop", 2, 1)
    assert done.ttft is not None and done.e2e >= done.ttft >= 0
    assert w.in_flight() == 0 and w.key_streams() == 0 and w.lifecycle.get(s.request_id) is None
    assert w.key_tokens() == pytest.approx(before + MAX_TOKENS - 2, abs=3)  # the unused 8 refunded (the bucket refills 100/s meanwhile)
    assert w.cancels == []  # it ended on its worker: nothing to cancel, not even when the owner left
    assert w.value("lockgate:request_success_total", **ok("stop")) == 1
    assert w.value("lockgate:request_success_total", **ok("abort")) == 0
    assert w.value("lockgate:generation_tokens_total", model="m", tier="p1", api="openai") == 2
    assert w.value("lockgate:time_to_first_token_seconds_count", model="m", tier="p1", api="openai") == 1
    assert w.value("lockgate:e2e_request_latency_seconds_count", model="m", tier="p1", api="openai") == 1


async def test_a_failed_stream_is_counted_as_refused_and_released_once() -> None:
    w = World()
    with OwnedStreams(w.lifecycle) as owned:
        s, sink = w.open(owned)
        assert w.lifecycle.fail(s, ErrorCode.OVERLOADED, "busy", 2.0)
        assert not w.lifecycle.fail(s, ErrorCode.OVERLOADED, "busy", 2.0)
    assert sink.ends == [Failed(ErrorCode.OVERLOADED, "busy", 2.0)]
    assert w.in_flight() == 0 and w.key_streams() == 0
    assert w.value("lockgate:edge_rejections_total", reason="overloaded", api="openai") == 1
    assert w.value("lockgate:request_success_total", **ok("abort")) == 0
    assert w.cancels == []


async def test_a_handler_leaving_cancels_its_open_streams_once() -> None:
    w = World()
    with OwnedStreams(w.lifecycle) as owned:
        a, sink_a = w.open(owned)
        b, sink_b = w.open(owned)
        w.lifecycle.finish(b, finished(b))
        w.lifecycle.delta(a, 0, "x", (7,), None)
        a.next_seq = 1
    [end] = sink_a.ends
    assert isinstance(end, Cancelled) and (end.reason, end.completion_tokens) == ("disconnect", 1)
    assert len(sink_b.ends) == 1 and isinstance(sink_b.ends[0], Done)
    assert w.cancels == [(a.request_id, "disconnect")]
    assert w.in_flight() == 0 and w.key_streams() == 0
    assert w.value("lockgate:request_success_total", **ok("abort")) == 1
    # a late reply for the cancelled stream finds nothing to route to
    router = ReplyRouter(None, "t", w.metrics, w.lifecycle)  # type: ignore[arg-type]  # _route_one reads no bus
    router._route_one(finished(a), None)  # type: ignore[arg-type]
    router._route_one(TokenChunk(a.request_id, 0, 1, (8,), "y", 1), None)  # type: ignore[arg-type]
    assert len(sink_a.ends) == 1 and len(sink_a.deltas) == 1
    assert w.value("lockgate:edge_orphan_replies_total") == 2


async def test_a_cancelled_handler_releases_its_stream_once() -> None:
    w = World()
    opened: list[tuple[Stream, Sink]] = []

    async def handler() -> None:
        with OwnedStreams(w.lifecycle) as owned:
            opened.append(w.open(owned))
            await asyncio.Event().wait()  # waiting for the answer when the client goes away

    task = asyncio.create_task(handler())
    while not opened:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s, sink = opened[0]
    assert len(sink.ends) == 1 and isinstance(sink.ends[0], Cancelled) and sink.ends[0].reason == "disconnect"
    assert w.cancels == [(s.request_id, "disconnect")]
    assert w.in_flight() == 0 and w.key_streams() == 0
    assert w.key_tokens() == pytest.approx(6000 - PROMPT, abs=3)  # all of max_tokens refunded


async def test_a_client_cancel_counts_an_abort_and_the_owner_adds_nothing() -> None:
    w = World()
    with OwnedStreams(w.lifecycle) as owned:
        s, sink = w.open(owned)
        assert w.lifecycle.cancel(s, "client")
    assert len(sink.ends) == 1 and isinstance(sink.ends[0], Cancelled) and sink.ends[0].reason == "client"
    assert sink.ends[0].ttft is None  # no token reached it
    assert w.cancels == [(s.request_id, "client")]
    assert w.value("lockgate:request_success_total", **ok("abort")) == 1
    assert w.value("lockgate:e2e_request_latency_seconds_count", model="m", tier="p1", api="openai") == 0


async def test_a_sink_that_cannot_keep_up_fails_its_stream_as_a_slow_client() -> None:
    w = World()
    with OwnedStreams(w.lifecycle) as owned:
        s, sink = w.open(owned, Sink(take=1))
        w.lifecycle.delta(s, 0, "a", (1,), None)
        assert sink.ends == []
        w.lifecycle.delta(s, 1, "b", (2,), None)  # the second is one too many
    assert sink.ends == [Failed(ErrorCode.OVERLOADED, "client too slow: events not read")]
    assert w.cancels == [(s.request_id, "slow_client")]
    assert w.value("lockgate:edge_slow_client_disconnects_total") == 1
    assert w.value("lockgate:edge_rejections_total", reason="overloaded", api="openai") == 1
    assert w.in_flight() == 0 and w.key_streams() == 0


async def test_expire_fails_only_the_streams_past_their_deadline() -> None:
    w = World()
    now = asyncio.get_running_loop().time()
    with OwnedStreams(w.lifecycle) as owned:
        late, late_sink = w.open(owned, deadline=now - 1)
        live, live_sink = w.open(owned, deadline=now + 3600)
        w.lifecycle.expire(now)
        assert late_sink.ends == [Failed(ErrorCode.EXPIRED, "no reply before the request deadline")]
        assert live_sink.ends == [] and w.lifecycle.get(live.request_id) is live
    assert w.cancels == [(late.request_id, "expired"), (live.request_id, "disconnect")]
    assert len(live_sink.ends) == 1


async def test_an_owner_keeps_only_its_open_streams() -> None:
    w = World()
    with OwnedStreams(w.lifecycle) as owned:
        for _ in range(200):
            s, _sink = w.open(owned)
            w.lifecycle.finish(s, finished(s))
        s, _sink = w.open(owned)
        assert owned.open() == [s]
        assert len(owned._streams) <= 32  # ended streams are dropped as it goes (a long WebSocket connection)
