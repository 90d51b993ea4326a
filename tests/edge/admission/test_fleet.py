"""Fleet-wide key limits, the pure core (edge/admission/fleet.py) and its use by the rate limiter:
shares from heartbeats, liveness on the bus's clock, fail closed on a stale view. No I/O: every
test drives the clock and the heartbeats by hand."""

from __future__ import annotations

import random

import pytest

from bus import EdgeStatus, KeyLoad, decode, encode
from edge.admission.fleet import FLOOR, FleetLimits, apportion, key_id, weights
from edge.admission.ratelimit import RateLimiter
from edge.config import ConfigError, EdgeConfig, KeyEntry, hash_key

STALE = 3.0
ENTRY = KeyEntry(hash_key("k"), "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=4)
KID = key_id(ENTRY.key_hash)


def peer(name: str, *loads: KeyLoad, gone: bool = False, members: tuple[str, ...] = ("a", "b")) -> EdgeStatus:
    return EdgeStatus(name, 0.0, 1, gone, loads, members)


def fleet_of(name: str = "a", now: float = 0.0) -> FleetLimits:
    """A view that has read its own heartbeats back at ``now`` (fresh, ready)."""
    f = FleetLimits(name, STALE, {ENTRY.key_hash: ENTRY})
    for _ in range(2):  # the first one, sent before any echo, reserves nothing
        f.observe(f.status({}, now, 0.0), now)
    assert f.ready()
    return f


def sync(f: FleetLimits, now: float, streams: dict[str, int] | None = None) -> EdgeStatus:
    """Publish a heartbeat and read it back at once."""
    st = f.status(streams or {}, now, now)
    f.observe(st, now)
    return st


def test_weights_and_apportion_sum_exactly() -> None:
    assert weights([0, 0, 0]) == [pytest.approx(1 / 3)] * 3
    w = weights([3.0, 1.0, 0.0])
    assert sum(w) == pytest.approx(1.0)
    assert w[2] == pytest.approx(FLOOR / 3) and w[0] == pytest.approx(FLOOR / 3 + (1 - FLOOR) * 0.75)
    for total in (0, 1, 2, 5, 16, 17):
        for fr in ([0.5, 0.5], [0.9, 0.1], [1 / 3] * 3, [0.7, 0.2, 0.1]):
            parts = apportion(total, fr)
            assert sum(parts) == total and all(abs(p - total * f) < 1 for p, f in zip(parts, fr, strict=True))
    assert apportion(1, [0.5, 0.5]) == [1, 0]  # a tie goes to the lower index (edge id order): same everywhere


def test_alone_an_edge_has_the_whole_key() -> None:
    f = fleet_of()
    s = f.share(ENTRY, 1.0)
    assert s.rate == 1.0 and s.streams == 4 and f.live_edges() == 1


def test_two_idle_edges_split_evenly_and_both_compute_the_same_split() -> None:
    a, b = fleet_of("a"), fleet_of("b")
    a.observe(peer("b"), 0.1)
    b.observe(peer("a"), 0.1)
    sa, sb = a.share(ENTRY, 1.0), b.share(ENTRY, 1.0)
    assert sa.rate == sb.rate == 0.5
    assert sa.streams is not None and sb.streams is not None and sa.streams + sb.streams == 4


def test_rate_share_follows_demand_and_the_splits_sum_to_one() -> None:
    a, b = fleet_of("a"), fleet_of("b")
    for t in range(20):  # a key busy on a only
        a.attempted(ENTRY.key_hash, None, t * 0.05)
    st_a, st_b = a.status({ENTRY.key_hash: 1}, 1.0, 1.0), b.status({}, 1.0, 1.0)
    for f in (a, b):
        f.observe(st_a, 1.1)
        f.observe(st_b, 1.1)
    sa, sb = a.share(ENTRY, 1.0), b.share(ENTRY, 1.0)
    assert sa.rate == pytest.approx(1 - FLOOR / 2) and sb.rate == pytest.approx(FLOOR / 2)
    assert sa.rate + sb.rate == pytest.approx(1.0)
    assert st_a.keys[0].key == KID and st_a.keys[0].streams == 1 and st_a.keys[0].demand > 0
    assert st_b.keys == ()  # no load at b: the key is not listed


def test_streams_are_capped_by_what_the_other_edges_claim() -> None:
    a = fleet_of("a")
    a.observe(peer("b", KeyLoad(KID, 0.0, 3, 3.0, 3)), 0.4)  # b holds and claims 3 of the key's 4
    for _ in range(3):
        a.attempted(ENTRY.key_hash, "max_streams", 0.4)  # as much stream demand at a: its target is 2
    st = sync(a, 0.5)
    assert st.keys[0].claim == 2
    assert a.share(ENTRY, 1.0).streams == 1  # what b's claim leaves, not a's target


def test_a_raised_claim_is_used_only_once_read_back_a_lowered_one_at_once() -> None:
    a = fleet_of("a")
    a.observe(peer("b", KeyLoad(KID, 0.0, 0, 0.0, 0)), 0.1)  # b lists the key and claims none of it
    st = a.status({}, 0.2, 0.2)  # no stream demand anywhere: a's target is the even 2
    assert st.keys[0].claim == 2
    assert a.share(ENTRY, 1.0).streams == 2  # its even share among a, b
    for t in range(5):
        a.attempted(ENTRY.key_hash, "max_streams", 0.3 + t * 0.01)
    st2 = a.status({}, 0.4, 0.4)  # now all the stream demand is a's: it claims all 4
    assert st2.keys[0].claim == 4
    assert a.share(ENTRY, 1.0).streams == 2  # not read back yet: not usable
    a.observe(st, 0.45)
    assert a.share(ENTRY, 1.0).streams == 2  # the first one back: 2 is still the least outstanding claim
    a.observe(st2, 0.5)
    assert a.share(ENTRY, 1.0).streams == 4
    a.observe(peer("b", KeyLoad(KID, 5.0, 0, 50.0, 3)), 0.6)  # b claims 3: a must fit beside it
    assert a.share(ENTRY, 1.0).streams == 1


def test_a_newcomer_gets_room_only_once_the_others_count_it() -> None:
    c = FleetLimits("c", STALE, {ENTRY.key_hash: ENTRY})
    c.observe(peer("a", members=("a", "b")), 0.0)  # a and b count each other, not c: 2 + 2 of 4
    c.observe(peer("b", members=("a", "b")), 0.0)
    sync(c, 0.1)
    assert sync(c, 0.1).members == ("a", "b", "c") and c.ready()
    assert c.share(ENTRY, 1.0).streams == 0
    c.observe(peer("a", members=("a", "b", "c")), 0.2)  # apportion(4, 3 even) = 2, 1, 1 by id
    assert c.share(ENTRY, 1.0).streams == 0  # b still counts 2
    c.observe(peer("b", members=("a", "b", "c")), 0.3)
    assert c.share(ENTRY, 1.0).streams == 1


def test_streams_never_exceed_the_limit_under_any_interleaving() -> None:
    """Three edges, one log: heartbeats, reads, admissions and stream ends in random order (seeded),
    the demand moving from edge to edge; the streams of all edges together never pass max_streams,
    and each edge gets streams while the demand is there."""
    entry = KeyEntry(hash_key("s"), "acme", 1, requests_per_min=0, tokens_per_min=0, max_streams=4)
    for seed in range(60):
        rnd = random.Random(seed)
        names = ["a", "b", "c"]
        edges = {n: FleetLimits(n, 1e9, {entry.key_hash: entry}) for n in names}
        limiters = {n: RateLimiter(edges[n]) for n in names}
        log: list[EdgeStatus] = []
        cursor = dict.fromkeys(names, 0)
        held = dict.fromkeys(names, 0)
        admitted = dict.fromkeys(names, 0)
        now = 0.0
        for step in range(1500):
            now += 0.001
            n = rnd.choice(names)
            op = rnd.random()
            if op < 0.15:
                log.append(edges[n].status({entry.key_hash: held[n]} if held[n] else {}, now, now))
            elif op < 0.45:
                for st in log[cursor[n]:cursor[n] + rnd.randint(1, 3)]:
                    edges[n].observe(st, now)
                    cursor[n] += 1
            elif op < 0.95:
                busy = names[(step // 100) % 3]  # the demand moves every 100 steps
                if (n == busy or rnd.random() < 0.2) and limiters[n].admit(entry, 1, now) is None:
                    held[n] += 1
                    admitted[n] += 1
            elif held[n]:
                limiters[n].release(entry, 0, now)
                held[n] -= 1
            assert sum(held.values()) <= entry.max_streams, (seed, step, held)
        assert all(admitted.values()), (seed, admitted)


def test_limiter_admits_at_most_its_share() -> None:
    a = fleet_of("a")
    a.observe(peer("b"), 0.0)
    lim = RateLimiter(a)
    admitted = sum(lim.admit(ENTRY, 10, 0.0) is None for _ in range(100))
    assert admitted == 2  # half of max_streams=4 (b's even share is 2): streams bind first
    e = KeyEntry(hash_key("r"), "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=0)
    admitted = sum(lim.admit(e, 10, 0.0) is None for _ in range(100))
    assert admitted == 30  # half of the 60-request bucket, at the same instant
    refused = lim.admit(e, 10, 0.0)
    # b has no demand: a's fraction grew with its own (live) demand, so its bucket refills faster
    # than half the key's rate, but held no more than its half when the burst came
    assert refused is not None and refused.field == "requests_per_min" and 1.0 < (refused.retry_after or 0) <= 2.01
    assert not refused.overloaded


def test_a_smaller_share_cuts_the_bucket_a_larger_one_only_refills_faster() -> None:
    a = fleet_of("a")
    lim = RateLimiter(a)
    e = KeyEntry(hash_key("r"), "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=0)
    assert lim.admit(e, 1, 0.0) is None  # alone: a 60-request bucket, 59 left
    a.observe(peer("b", KeyLoad(key_id(e.key_hash), 100.0)), 0.1)  # b has far more demand: a keeps ~5 %
    n = sum(lim.admit(e, 1, 0.1) is None for _ in range(100))
    assert 2 <= n <= 4  # the bucket was cut to ~3 requests at once
    a.observe(peer("b", gone=True), 0.2)  # b left: a's share is 1 again, the level does not jump
    assert lim.admit(e, 1, 0.2) is not None  # ~0.01 requests refilled: none yet
    assert sum(lim.admit(e, 1, 1.3) is None for _ in range(100)) == 1  # 1.1 s more at the full 1/s: one


def test_a_burst_on_two_edges_at_once_is_not_cut_by_the_first_heartbeat() -> None:
    """Each edge weighs its own live demand: b, whose burst started just as a's did, keeps its half
    when a's heartbeat (all demand a's) arrives before b has published any."""
    b = fleet_of("b")
    b.observe(peer("a"), 0.0)
    lim = RateLimiter(b)
    e = KeyEntry(hash_key("r"), "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=0)
    assert sum(lim.admit(e, 1, 0.0) is None for _ in range(10)) == 10  # b's burst begins: 20 of its 30 left
    b.observe(peer("a", KeyLoad(key_id(e.key_hash), 2.0)), 0.01)  # a's burst, published
    assert sum(lim.admit(e, 1, 0.01) is None for _ in range(100)) == 20


def test_peers_expire_on_the_bus_clock_not_the_wall_clock() -> None:
    a = fleet_of("a", now=0.0)
    a.observe(peer("b"), 0.0)
    assert a.live_edges() == 2
    # our own heartbeats stop coming back (the bus is slow): b is not expired, however long
    assert a.live_edges() == 2 and a.share(ENTRY, 1.0).rate == 0.5
    # and after stale_s / 2 without an echo the view is stale: limited keys are refused (fail closed)
    assert a.fresh(STALE / 2) and not a.fresh(STALE / 2 + 0.01)
    lim = RateLimiter(a)
    r = lim.admit(ENTRY, 1, STALE + 1)
    assert r is not None and r.overloaded and r.field == "fleet_limits"
    unlimited = KeyEntry(hash_key("u"), "dev", 1, 0, 0, 0)
    assert lim.admit(unlimited, 1, STALE + 1) is None  # a key without limits does not depend on the fleet
    # the bus is back: our echoes flow, and b (silent since 0.0) expires once stale_s of them passed
    a.observe(a.status({}, 10.0, 10.0), 10.0)
    assert a.live_edges() == 1 and a.share(ENTRY, 1.0).rate == 1.0 and a.fresh(10.0)


def test_a_peer_that_keeps_talking_stays_and_a_gone_peer_leaves_at_once() -> None:
    a = fleet_of("a", now=0.0)
    for t in range(1, 20):
        a.observe(peer("b"), t * 0.5)
        a.observe(a.status({}, t * 0.5, 0.0), t * 0.5)
    assert a.live_edges() == 2
    a.observe(peer("b", gone=True), 10.0)
    assert a.live_edges() == 1


def test_a_fresh_edge_is_stale_until_its_own_heartbeat_comes_back() -> None:
    f = FleetLimits("new", STALE, {ENTRY.key_hash: ENTRY})
    assert not f.fresh(0.0)
    st = f.status({}, 0.0, 0.0)
    assert st.members == ()  # sent before it read the others': it reserves nothing
    assert not f.fresh(0.0) and f.share(ENTRY, 1.0).streams == 0 and not f.ready()
    f.observe(st, 0.05)
    assert f.fresh(0.05) and f.share(ENTRY, 1.0).streams == 0 and not f.ready()
    st = f.status({}, 0.1, 0.1)
    assert st.members == ("new",)
    f.observe(st, 0.15)
    assert f.ready() and f.share(ENTRY, 1.0).streams == 4


def test_idle_keys_are_forgotten_and_the_heartbeat_round_trips_the_codec() -> None:
    f = fleet_of("a")
    f.attempted(ENTRY.key_hash, None, 0.0)
    st = f.status({}, 0.0, 123.0)
    assert decode(encode(st)) == st and len(st.keys) == 1
    st = f.status({}, 120.0, 124.0)  # two minutes later, nothing in flight: decayed and dropped
    assert st.keys == () and decode(encode(peer("x", gone=True))).gone


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="instance"):
        FleetLimits("", 1.0)
    with pytest.raises(ValueError, match="stale_s"):
        FleetLimits("a", 0)


def test_the_config_checks_the_fleet_timings() -> None:
    with pytest.raises(ConfigError, match="fleet_edge_stale_s at least 4 times"):
        EdgeConfig(model="m", fleet_sync_interval_s=1.0, fleet_edge_stale_s=3.5)
    with pytest.raises(ConfigError, match="fleet_sync_interval_s must be > 0"):
        EdgeConfig(model="m", fleet_sync_interval_s=0)
    assert EdgeConfig(model="m").fleet_limits  # on by default (dev mode has no limits to share)


def test_heartbeats_that_never_come_back_are_dropped_and_then_nothing_is_held() -> None:
    from edge.admission.fleet import MAX_UNECHOED

    a = fleet_of("a")
    assert a.share(ENTRY, 1.0).streams == 4
    for t in range(MAX_UNECHOED + 1):  # the bus away: none comes back
        a.status({}, 1.0 + t, 1.0 + t)
    assert a.share(ENTRY, 100.0).streams == 0  # memory stays bounded, and the edge claims nothing
    sync(a, 101.0)
    assert a.share(ENTRY, 101.0).streams == 4  # one came back: its claim is usable again
