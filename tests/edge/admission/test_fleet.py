"""Fleet-wide key limits, the pure core (edge/admission/fleet.py) and its use by the rate limiter:
shares from heartbeats, liveness on the bus's clock, fail closed on a stale view. No I/O: every
test drives the clock and the heartbeats by hand."""

from __future__ import annotations

import pytest

from bus import EdgeStatus, KeyLoad, decode, encode
from edge.admission.fleet import FLOOR, FleetLimits, apportion, key_id, weights
from edge.admission.ratelimit import RateLimiter
from edge.config import ConfigError, EdgeConfig, KeyEntry, hash_key

STALE = 3.0
ENTRY = KeyEntry(hash_key("k"), "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=4)
KID = key_id(ENTRY.key_hash)


def peer(name: str, *loads: KeyLoad, gone: bool = False) -> EdgeStatus:
    return EdgeStatus(name, 0.0, 1, gone, loads)


def fleet_of(name: str = "a", now: float = 0.0) -> FleetLimits:
    """A view that has read its own heartbeat back at ``now`` (fresh)."""
    f = FleetLimits(name, STALE)
    f.observe(f.status({}, now, 0.0), now)
    return f


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
    s = f.share(ENTRY)
    assert s.rate == 1.0 and s.streams == 4 and f.live_edges() == 1


def test_two_idle_edges_split_evenly_and_both_compute_the_same_split() -> None:
    a, b = fleet_of("a"), fleet_of("b")
    a.observe(peer("b"), 0.1)
    b.observe(peer("a"), 0.1)
    sa, sb = a.share(ENTRY), b.share(ENTRY)
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
    sa, sb = a.share(ENTRY), b.share(ENTRY)
    assert sa.rate == pytest.approx(1 - FLOOR / 2) and sb.rate == pytest.approx(FLOOR / 2)
    assert sa.rate + sb.rate == pytest.approx(1.0)
    assert st_a.keys[0].key == KID and st_a.keys[0].streams == 1 and st_a.keys[0].demand > 0
    assert st_b.keys == ()  # no load at b: the key is not listed


def test_streams_are_capped_by_what_the_other_edges_hold() -> None:
    a = fleet_of("a")
    # b reports 3 of the key's 4 streams but little demand: a's allocation would be larger,
    # yet a may only use what b leaves (a stream cannot be taken back)
    a.attempted(ENTRY.key_hash, "max_streams", 0.2)
    a.observe(a.status({}, 0.3, 0.3), 0.3)
    a.observe(peer("b", KeyLoad(KID, 0.0, 3, 0.0)), 0.4)
    s = a.share(ENTRY)
    assert s.streams == 1


def test_limiter_admits_at_most_its_share() -> None:
    a = fleet_of("a")
    a.observe(peer("b"), 0.0)
    lim = RateLimiter(a)
    admitted = sum(lim.admit(ENTRY, 10, 0.0) is None for _ in range(100))
    assert admitted == 2  # half of max_streams=4: streams bind first
    e = KeyEntry(hash_key("r"), "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=0)
    admitted = sum(lim.admit(e, 10, 0.0) is None for _ in range(100))
    assert admitted == 30  # half of the 60-request bucket, at the same instant
    refused = lim.admit(e, 10, 0.0)
    assert refused is not None and refused.field == "requests_per_min" and 1.9 < (refused.retry_after or 0) <= 2.01
    assert not refused.overloaded


def test_a_smaller_share_cuts_the_bucket_a_larger_one_only_refills_faster() -> None:
    a = fleet_of("a")
    lim = RateLimiter(a)
    e = KeyEntry(hash_key("r"), "acme", 1, requests_per_min=60, tokens_per_min=0, max_streams=0)
    assert lim.admit(e, 1, 0.0) is None  # alone: a 60-request bucket, 59 left
    a.observe(peer("b"), 0.1)  # a second edge: a's bucket is cut to 30
    assert sum(lim.admit(e, 1, 0.1) is None for _ in range(100)) == 30
    a.observe(peer("b", gone=True), 0.2)  # b left: a's share is 1 again, the level does not jump
    assert lim.admit(e, 1, 0.2) is not None  # ~0.05 requests refilled at 0.5/s: none yet
    assert sum(lim.admit(e, 1, 1.3) is None for _ in range(100)) == 1  # 1.1 s more at the full 1/s: one


def test_peers_expire_on_the_bus_clock_not_the_wall_clock() -> None:
    a = fleet_of("a", now=0.0)
    a.observe(peer("b"), 0.0)
    assert a.live_edges() == 2
    # our own heartbeats stop coming back (the bus is slow): b is not expired, however long
    assert a.live_edges() == 2 and a.share(ENTRY).rate == 0.5
    # and after stale_s without an echo the view is stale: limited keys are refused (fail closed)
    assert a.fresh(STALE) and not a.fresh(STALE + 0.01)
    lim = RateLimiter(a)
    r = lim.admit(ENTRY, 1, STALE + 1)
    assert r is not None and r.overloaded and r.field == "fleet_limits"
    unlimited = KeyEntry(hash_key("u"), "dev", 1, 0, 0, 0)
    assert lim.admit(unlimited, 1, STALE + 1) is None  # a key without limits does not depend on the fleet
    # the bus is back: our echoes flow, and b (silent since 0.0) expires once stale_s of them passed
    a.observe(a.status({}, 10.0, 10.0), 10.0)
    assert a.live_edges() == 1 and a.share(ENTRY).rate == 1.0 and a.fresh(10.0)


def test_a_peer_that_keeps_talking_stays_and_a_gone_peer_leaves_at_once() -> None:
    a = fleet_of("a", now=0.0)
    for t in range(1, 20):
        a.observe(peer("b"), t * 0.5)
        a.observe(a.status({}, t * 0.5, 0.0), t * 0.5)
    assert a.live_edges() == 2
    a.observe(peer("b", gone=True), 10.0)
    assert a.live_edges() == 1


def test_a_fresh_edge_is_stale_until_its_own_heartbeat_comes_back() -> None:
    f = FleetLimits("new", STALE)
    assert not f.fresh(0.0)
    f.status({}, 0.0, 0.0)
    assert not f.fresh(0.0)
    f.observe(peer("new"), 0.05)
    assert f.fresh(0.05)


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
    with pytest.raises(ConfigError, match="fleet_edge_stale_s at least twice"):
        EdgeConfig(model="m", fleet_sync_interval_s=1.0, fleet_edge_stale_s=1.5)
    with pytest.raises(ConfigError, match="fleet_sync_interval_s must be > 0"):
        EdgeConfig(model="m", fleet_sync_interval_s=0)
    assert EdgeConfig(model="m").fleet_limits  # on by default (dev mode has no limits to share)
