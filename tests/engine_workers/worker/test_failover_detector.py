"""The failover detector (sans-I/O): heartbeats in, "peer X dead at t" out."""

from __future__ import annotations

from collections import Counter

import pytest

from bus import PartitionHold, WorkerStatus
from engine_workers.worker.failover.detector import FORGET_S, PeerDetector, affinity, owner, takeover_candidates


def beat(wid: str, *, draining: bool = False, taken: tuple[str, ...] = (), model: str = "m",
         holds: tuple[PartitionHold, ...] = ()) -> WorkerStatus:
    return WorkerStatus(wid, model, 0.0, draining=draining, taken=taken, holds=holds)


def beats(d: PeerDetector, wid: str, start: float, n: int, period: float = 0.25, **kw) -> float:
    t = start
    for _ in range(n):
        d.observe(beat(wid, **kw), t)
        t += period
    return t - period


def test_a_peer_seen_once_is_watched_by_default() -> None:
    d = PeerDetector("me", "m", detect_s=0.75)
    d.observe(beat("a"), 0.0)
    assert [x.worker_id for x in d.expired(1.0)] == ["a"]


def test_silent_peer_is_dead_after_the_detection_time_once() -> None:
    d = PeerDetector("me", "m", detect_s=0.75)
    last = beats(d, "a", 0.0, 4)
    assert d.expired(last + 0.75) == []  # exactly detect_s: not yet
    deaths = d.expired(last + 0.76)
    assert [(x.worker_id, x.at) for x in deaths] == [("a", pytest.approx(last + 0.75))]
    assert d.expired(last + 5) == []  # one verdict per death
    assert d.live() == ["me"]


def test_steady_peer_is_never_presumed_dead() -> None:
    d = PeerDetector("me", "m", detect_s=0.75)
    t = 0.0
    for _ in range(100):
        d.observe(beat("a"), t)
        t += 0.5  # slower than the period used elsewhere, still within detect_s
        assert d.expired(t) == []
    assert d.live() == ["a", "me"]


def test_min_beats_and_other_models_and_self_are_ignored() -> None:
    d = PeerDetector("me", "m", detect_s=0.75, min_beats=2)
    d.observe(beat("a"), 0.0)
    beats(d, "x", 0.0, 5, model="other")
    beats(d, "me", 0.0, 5)  # our own heartbeats come back on the topic
    assert d.expired(10.0) == []
    assert d.live() == ["me"]


def test_draining_peer_that_goes_silent_left_and_is_not_dead() -> None:
    d = PeerDetector("me", "m", detect_s=0.75)
    last = beats(d, "a", 0.0, 3)
    d.observe(beat("a", draining=True), last + 0.25)
    assert d.expired(last + 5) == []
    assert d.live() == ["me"]


def test_hysteresis_a_paused_peer_rejoins_only_after_steady_beats() -> None:
    d = PeerDetector("me", "m", detect_s=0.75, rejoin_beats=2)
    last = beats(d, "a", 0.0, 4, taken=("r1",))
    assert d.claimed("r1")
    assert [x.worker_id for x in d.expired(last + 2.0)] == ["a"]
    assert not d.claimed("r1")  # a dead peer's claims do not count
    d.observe(beat("a", taken=("r1",)), last + 3.0)  # SIGCONT: one beat
    assert d.live() == ["me"] and not d.claimed("r1")
    d.observe(beat("a", taken=("r1",)), last + 3.25)
    assert d.live() == ["a", "me"] and d.claimed("r1")
    # It can die again, and is reported again (the worker asks every tick).
    assert d.expired(last + 3.3) == [] and d.expired(last + 3.7) == []
    assert [x.worker_id for x in d.expired(last + 4.1)] == ["a"]


def test_owned_elsewhere_reads_live_peers_holds() -> None:
    d = PeerDetector("me", "m", detect_s=0.75)
    beats(d, "a", 0.0, 2, holds=(PartitionHold("t", 3, 0),))
    assert d.owned_elsewhere("t", 3) and not d.owned_elsewhere("t", 2)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="detect_s"):
        PeerDetector("me", "m", detect_s=0)
    with pytest.raises(ValueError, match="rejoin_beats"):
        PeerDetector("me", "m", detect_s=1, rejoin_beats=0)


def test_owner_is_deterministic_spread_and_stable() -> None:
    live = ["w1", "w2", "w3"]
    picks = {f"req-{i}": owner(f"req-{i}", live) for i in range(3000)}
    assert picks == {r: owner(r, reversed(live)) for r in picks}  # order of the live set does not matter
    counts = Counter(picks.values())
    assert set(counts) == set(live) and min(counts.values()) > 850
    # w3 leaves: only its requests move.
    after = {r: owner(r, ["w1", "w2"]) for r in picks}
    assert all(after[r] == w for r, w in picks.items() if w != "w3")
    assert owner("x", []) is None


def test_takeovers_follow_the_edges_placement() -> None:
    """Requests the edge keyed by one prefix onto one partition go to one survivor together (its
    prefix cache serves them); the same prefix spilled onto other partitions spreads as the edge
    spread it; a record keyed by its request id (or unkeyed) is placed by the request id alone."""
    live = ["w1", "w2", "w3", "w4"]
    prefix = b"9f2c41d0e5a7b3c8d1e6f0a2"
    together = {owner(affinity(f"req-{i}", prefix, "ns.p1", 2), live) for i in range(50)}
    assert len(together) == 1
    spilled = {owner(affinity("req-0", prefix, "ns.p1", p), live) for p in range(32)}
    assert len(spilled) > 1
    alone = [f"req-{i}" for i in range(200)]
    assert all(affinity(r, r.encode(), "ns.p1", 2) == r and affinity(r, None, "ns.p1", 2) == r for r in alone)
    assert len({owner(affinity(r, r.encode(), "ns.p1", 2), live) for r in alone}) == len(live)


def test_takeover_prefers_a_matching_numerics_fingerprint() -> None:
    fp = {"a": "bf16/avx512", "b": "fp32/avx2", "me": "fp32/avx2"}
    assert takeover_candidates(["a", "b", "me"], "fp32/avx2", fp) == ["b", "me"]
    assert takeover_candidates(["a", "b", "me"], "int8/amx", fp) == ["a", "b", "me"]  # none matches: anyone


def test_our_own_stall_restarts_the_peers_clocks() -> None:
    d = PeerDetector("me", "m", detect_s=0.75)
    last = beats(d, "a", 0.0, 4)
    assert d.expired(last + 0.1) == []
    # this worker was paused for 5 s: the peer's beats of that time have not been read yet
    assert d.expired(last + 5.1) == []
    d.observe(beat("a"), last + 5.2)
    assert d.live() == ["a", "me"]
    # a peer silent after our stall is still detected, one detection time later
    assert d.expired(last + 5.6) == []
    assert [x.worker_id for x in d.expired(last + 5.2 + 0.8)] == ["a"]


def test_a_restarted_peer_dying_again_before_it_rejoined_is_reported_again() -> None:
    d = PeerDetector("me", "m", detect_s=0.75, rejoin_beats=2)
    last = beats(d, "a", 0.0, 4)
    assert [x.worker_id for x in d.expired(last + 0.8)] == ["a"]
    d.observe(beat("a"), last + 1.0)  # restarted under the same id: one beat, not live yet
    assert d.live() == ["me"]
    assert d.expired(last + 1.5) == []
    assert [x.worker_id for x in d.expired(last + 1.8)] == ["a"]
    assert d.expired(last + 2.2) == []


def test_a_long_dead_peer_is_forgotten() -> None:
    d = PeerDetector("me", "m", detect_s=0.75)
    last = beats(d, "a", 0.0, 2)
    assert [x.worker_id for x in d.expired(last + 1)] == ["a"]
    d.expired(last + 1 + FORGET_S + 1)
    assert d.numerics_of("a") is None  # nothing kept of it


def test_no_verdict_while_our_own_heartbeats_do_not_come_back() -> None:
    """The status topic has one partition: until one of our own heartbeats comes back, the peers'
    heartbeats sent meanwhile may still be unread (we were paused, our reader lags): a silent peer
    is not presumed dead then. Once ours come back again, a peer still silent is."""
    d = PeerDetector("me", "m", detect_s=0.75)
    for i in range(4):
        t = i * 0.25
        d.observe(beat("a"), t)
        d.observe(beat("me"), t + 0.01)
        assert d.expired(t + 0.02) == []
    # our own heartbeats stop coming back at 0.76 (and a's too): ours are behind, no verdict
    for t in (1.0, 1.5, 2.0, 2.5, 3.0):
        assert d.expired(t) == []
    assert d.live() == ["a", "me"]
    # ours come back: the backlog before them held nothing of a's, so a is silent indeed
    d.observe(beat("me"), 3.1)
    assert [x.worker_id for x in d.expired(3.15)] == ["a"]


def test_a_backlog_read_with_our_own_heartbeat_clears_the_peer() -> None:
    d = PeerDetector("me", "m", detect_s=0.75)
    d.observe(beat("a"), 0.0)
    d.observe(beat("me"), 0.0)
    for t in (0.5, 1.0, 1.5):  # nothing read: our reader lags behind the topic
        assert d.expired(t) == []
    d.observe(beat("a"), 1.6)  # the backlog: a's heartbeats, then ours
    d.observe(beat("me"), 1.6)
    assert d.expired(1.7) == []
    assert d.live() == ["a", "me"]
