"""Fleet-wide key limits: how much of each API key's limits this edge may use, from the heartbeats
every edge publishes on ``<ns>.edges`` (docs/protocol.md, "Fleet-wide limits"). Pure and
synchronous: callers pass ``now`` (monotonic seconds); the async shell is
:mod:`edge.admission.fleetsync`.

Every edge publishes, each sync interval, an :class:`~bus.EdgeStatus`: the edges it counts
(``members``) and, per key with load here or at another edge, the attempted requests per second
(``demand``, admitted or refused), the streams in flight, ``stream_demand`` (streams plus recent
``max_streams`` refusals) and its ``claim`` on the key's ``max_streams``. The heartbeat topic has one
partition: every edge reads the same heartbeats in the same order, and an edge that reads its own
heartbeat back (its *echo*) has read every earlier one.

* **Rate** (``requests_per_min``, ``tokens_per_min``): edge ``i`` of ``n`` gets the fraction
  ``FLOOR / n + (1 - FLOOR) * demand_i / sum(demand)`` (``1 / n`` while no edge has demand), from
  the others' last published demand and its own live one; its token buckets hold that fraction of
  the key's bucket (ratelimit.py: a smaller fraction cuts the bucket at once, a larger one only
  refills faster, so the fractions summing past 1 while the edges' views differ adds little).
* **Concurrency** (``max_streams``, strict): an edge holds a *claim* per key, and may hold at most
  ``min(its own claim, max_streams - the others' claims)`` streams. A key nobody lists is claimed
  by every edge at its even share of ``max_streams`` among the ``members`` of its heartbeat (so a
  first request is admitted at once); a listed key's claim is ``max(streams held, target)``, the
  target apportioning ``max_streams`` by ``stream_demand`` (the rate formula, largest remainders).
  Safety: an edge uses a raised claim only once its heartbeat announcing it came back, and a
  lowered one at once (its own bound is the least claim among its heartbeats not yet read back
  and the one last read back); the edge whose last echo is latest has read every other edge's
  claim that bounds that edge's use, so the streams of all edges never sum past ``max_streams``.
  A newcomer counts the others' claims as *their* heartbeats state them (their ``members`` without
  it: their larger even shares), so it gets room only once they have counted it.

Liveness is judged on the bus's clock: a peer is dead when ``stale_s`` of our own heartbeats have come
back since its last one (or it said ``gone``). When our heartbeats do not come back (the bus slow or
away) no peer expires, so nothing grows from silence, and after ``stale_s / 2`` without one this
edge's view is *stale*: it admits no request of a limited key (fail closed) until they come back —
half the time after which the others free its claims, to leave room for clock skew and delay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from bus import EdgeStatus, KeyLoad
from edge.config import KeyEntry

FLOOR = 0.1  # the part of a key's limit spread evenly over the live edges (the rest follows demand)
DEMAND_TAU_S = 5.0  # time constant of the decayed demand counters
KEY_HEX = 16  # the key-hash prefix a heartbeat names (64 bits: collisions are negligible)
MAX_KEYS_PER_STATUS = 4096  # the most keys one heartbeat lists (~120 bytes each)
MIN_DEMAND = 1e-3  # a key whose demand decayed below this and that holds no stream is left out
MAX_UNECHOED = 64  # heartbeats sent but not read back kept for the own bound; then they are dropped


@dataclass(frozen=True, slots=True)
class Share:
    """What this edge may use of one key: ``rate`` in (0, 1] of its per-minute limits, ``streams``
    the most streams it may hold (``None``: the key has no ``max_streams``)."""

    rate: float
    streams: int | None


class Decayed:
    """An exponentially decayed event count: ``rate()`` is events per second over ~``DEMAND_TAU_S``."""

    __slots__ = ("value", "stamp")

    def __init__(self, now: float) -> None:
        self.value = 0.0
        self.stamp = now

    def _decay(self, now: float) -> None:
        if now > self.stamp:
            self.value *= math.exp(-(now - self.stamp) / DEMAND_TAU_S)
            self.stamp = now

    def add(self, n: float, now: float) -> None:
        self._decay(now)
        self.value += n

    def rate(self, now: float) -> float:
        self._decay(now)
        return self.value / DEMAND_TAU_S


class _Demand:
    __slots__ = ("attempts", "stream_refusals")

    def __init__(self, now: float) -> None:
        self.attempts = Decayed(now)
        self.stream_refusals = Decayed(now)


class _Edge:
    """The last heartbeat heard from one edge (ours: the last one we published)."""

    __slots__ = ("loads", "members", "heard_at")

    def __init__(self, loads: dict[str, KeyLoad], members: tuple[str, ...], heard_at: float) -> None:
        self.loads = loads
        self.members = members
        self.heard_at = heard_at


class _Sent:
    """One of our heartbeats, for the own bound: its ``seq``, members and explicit claims."""

    __slots__ = ("seq", "members", "claims")

    def __init__(self, seq: int, members: tuple[str, ...], claims: dict[str, int]) -> None:
        self.seq = seq
        self.members = members
        self.claims = claims


def key_id(key_hash: str) -> str:
    """The name of a key in a heartbeat: a prefix of its SHA-256 hex."""
    return key_hash[:KEY_HEX]


def limited(entry: KeyEntry) -> bool:
    """Whether a key has any limit the fleet must share (dev mode's key has none)."""
    return bool(entry.requests_per_min or entry.tokens_per_min or entry.max_streams)


class FleetLimits:
    """One edge's view of the fleet and its shares. ``instance`` must be unique per process (an
    edge id may be shared by ``--reuse-port`` processes); ``keys``: the key file's entries, which
    give the ``max_streams`` of a key another edge lists. Not thread-safe; one event loop owns it."""

    def __init__(self, instance: str, stale_s: float, keys: Mapping[str, KeyEntry] | None = None) -> None:
        if not instance:
            raise ValueError("instance must be a non-empty id")
        if not stale_s > 0:
            raise ValueError(f"stale_s must be > 0, got {stale_s}")
        self.instance = instance
        self.stale_s = stale_s
        self._max_streams = {key_id(h): e.max_streams for h, e in (keys or {}).items() if e.max_streams}
        self._demand: dict[str, _Demand] = {}
        self._edges: dict[str, _Edge] = {}  # live edges by instance id, ours included once published
        self._echo_at: float | None = None  # when we last read our own heartbeat back
        self._sent: list[_Sent] = []  # the last heartbeat read back (first), then those not yet
        self._echoed = False
        self._seq = 0
        self._version = 0  # bumped whenever a split may change; keys the cache below
        self._cache: dict[tuple[str, int], tuple[int, int]] = {}  # (key, max_streams) -> (version, streams)
        self.truncated = False  # a heartbeat had to leave keys out (more than MAX_KEYS_PER_STATUS)

    # --- observations -------------------------------------------------------------------------
    def attempted(self, key_hash: str, refused: str | None, now: float) -> None:
        """A request of the key was admitted (``refused is None``) or refused by limit ``refused``."""
        d = self._demand.get(key_hash)
        if d is None:
            d = self._demand[key_hash] = _Demand(now)
        d.attempts.add(1, now)
        if refused == "max_streams":
            d.stream_refusals.add(1, now)

    def observe(self, st: EdgeStatus, now: float) -> None:
        """A heartbeat read from the bus, ours included, in the topic's order."""
        self._version += 1
        if st.edge_id == self.instance:
            self._echo_at = now
            i = next((i for i, s in enumerate(self._sent) if s.seq == st.seq), None)
            if i is not None:  # older ones no longer bound us: everyone reading this read those
                del self._sent[:i]
                self._echoed = True
            self._expire(now)
            return
        if st.gone:
            self._edges.pop(st.edge_id, None)
            return
        self._edges[st.edge_id] = _Edge({k.key: k for k in st.keys}, st.members, now)

    def _expire(self, now: float) -> None:
        dead = [e for e, v in self._edges.items() if e != self.instance and now - v.heard_at > self.stale_s]
        for e in dead:
            del self._edges[e]

    # --- publishing ---------------------------------------------------------------------------
    def members(self) -> tuple[str, ...]:
        return tuple(sorted(set(self._edges) | {self.instance}))

    def status(self, streams: Mapping[str, int], now: float, ts: float) -> EdgeStatus:
        """The heartbeat to publish now; ``streams``: streams in flight per key hash. From here on
        this edge's splits use exactly these values, as the other edges will."""
        held = {key_id(h): n for h, n in streams.items()}
        loads: dict[str, KeyLoad] = {}
        for h in set(self._demand) | set(streams):
            d = self._demand.get(h)
            demand = d.attempts.rate(now) if d is not None else 0.0
            refusals = d.stream_refusals.rate(now) * DEMAND_TAU_S if d is not None else 0.0
            n = streams.get(h, 0)
            if demand < MIN_DEMAND and n == 0:
                self._demand.pop(h, None)  # idle: forgotten (memory stays bounded by the active keys)
                continue
            loads[key_id(h)] = KeyLoad(key_id(h), round(demand, 4), n, round(n + refusals, 4))
        # a key another edge lists is listed here too, so this edge's claim on it is explicit
        for e, v in self._edges.items():
            if e != self.instance:
                for kid in v.loads:
                    if kid not in loads and kid in self._max_streams:
                        loads[kid] = KeyLoad(kid)
        self.truncated = len(loads) > MAX_KEYS_PER_STATUS
        keep = sorted(loads.values(), key=lambda k: (k.streams, k.stream_demand, k.demand), reverse=True)
        keep = keep[:MAX_KEYS_PER_STATUS]
        # Before its first echo an edge has not read the others' heartbeats: it names no members,
        # which claims nothing of the keys it does not list (it admits nothing yet either), instead
        # of a lone edge's whole key, which would stop the others until its next heartbeat.
        members = self.members() if self._echo_at is not None else ()
        # claims: from the loads just computed, this edge's as the others will read them
        self._edges[self.instance] = _Edge({k.key: k for k in keep}, members, now)
        out = []
        for k in keep:
            m = self._max_streams.get(k.key, 0)
            claim = max(held.get(k.key, 0), self._target(k.key, m)) if m else 0
            out.append(KeyLoad(k.key, k.demand, k.streams, k.stream_demand, claim))
        loads_out = {k.key: k for k in out}
        self._edges[self.instance] = _Edge(loads_out, members, now)
        self._seq += 1
        if len(self._sent) >= MAX_UNECHOED:
            # none came back for a long while (the bus away): forget them rather than grow, and
            # hold no stream until a new one comes back (an edge without an echo claims nothing)
            self._sent.clear()
            self._echoed = False
        self._sent.append(_Sent(self._seq, members, {k.key: k.claim for k in out}))
        self._version += 1
        return EdgeStatus(self.instance, ts, self._seq, False, tuple(sorted(out, key=lambda k: k.key)), members)

    def leaving(self, ts: float) -> EdgeStatus:
        """The last heartbeat of a stopping edge: the others drop it at once."""
        self._seq += 1
        return EdgeStatus(self.instance, ts, self._seq, True, (), ())

    # --- decisions ----------------------------------------------------------------------------
    def fresh(self, now: float) -> bool:
        """Our own heartbeat came back within ``stale_s / 2``: the view is current enough to admit on."""
        return self._echo_at is not None and now - self._echo_at <= self.stale_s / 2

    def ready(self) -> bool:
        """A heartbeat naming the members came back: this edge's even shares are usable (its first
        heartbeat, sent before it had read the others', reserves nothing)."""
        return self._echoed and bool(self._sent[0].members)

    def counted(self) -> bool:
        """Every other live edge's last heartbeat counts this one: it has room beside them."""
        return all(self.instance in v.members for e, v in self._edges.items() if e != self.instance)

    def live_edges(self) -> int:
        """Edges in the view, this one included (1 before anything was heard)."""
        return len(self._edges) + (self.instance not in self._edges)

    def share(self, entry: KeyEntry, now: float) -> Share:
        """This edge's part of ``entry``'s limits under the current view."""
        kid = key_id(entry.key_hash)
        streams: int | None = None
        if entry.max_streams:
            ck = (kid, entry.max_streams)
            hit = self._cache.get(ck)
            if hit is not None and hit[0] == self._version:
                streams = hit[1]
            else:
                streams = self._streams(kid, entry.max_streams)
                if len(self._cache) > 4 * MAX_KEYS_PER_STATUS:
                    self._cache.clear()
                self._cache[ck] = (self._version, streams)
        return Share(self._rate(entry.key_hash, now), streams)

    def _rate(self, key_hash: str, now: float) -> float:
        """The others' published demand, this edge's live one: when a key's traffic starts on two
        edges at once, the one that publishes first must not cut the other's bucket to its floor
        (a cut loses tokens). The fractions may then sum past 1 for an interval; buckets never
        jump up, so that only adds the excess x the refill rate x the interval (docs)."""
        kid = key_id(key_hash)
        ids = self.members()
        none = KeyLoad(kid)
        d = self._demand.get(key_hash)
        demands = [self._edges[e].loads.get(kid, none).demand if e in self._edges else 0.0 for e in ids]
        me = ids.index(self.instance)
        demands[me] = d.attempts.rate(now) if d is not None else 0.0
        return weights(demands)[me]

    def _target(self, kid: str, max_streams: int) -> int:
        """This edge's part of ``max_streams`` by stream demand, from the published loads."""
        ids = self.members()
        none = KeyLoad(kid)
        loads = [self._edges[e].loads.get(kid, none) if e in self._edges else none for e in ids]
        return apportion(max_streams, weights([k.stream_demand for k in loads]))[ids.index(self.instance)]

    def _streams(self, kid: str, max_streams: int) -> int:
        if not self._echoed:
            return 0
        own = min(s.claims[kid] if kid in s.claims else even_share(max_streams, s.members, self.instance)
                  for s in self._sent)
        if kid not in self._sent[-1].claims:  # a newcomer seen since: the even share shrinks at once
            own = min(own, even_share(max_streams, self.members(), self.instance))
        others = 0
        for e, v in self._edges.items():
            if e != self.instance:
                k = v.loads.get(kid)
                if k is not None:
                    others += k.claim
                else:  # its even share among the edges it counted (none before its first echo)
                    others += even_share(max_streams, v.members, e)
        return max(0, min(own, max_streams - others))


def even_share(total: int, members: tuple[str, ...], who: str) -> int:
    """``who``'s even share of ``total`` among ``members`` (sorted ids), 0 if not a member."""
    if who not in members:
        return 0
    return _even(total, len(members))[members.index(who)]


@lru_cache(maxsize=1024)
def _even(total: int, n: int) -> tuple[int, ...]:
    return tuple(apportion(total, [1.0 / n] * n))


def weights(demands: list[float]) -> list[float]:
    """Each edge's fraction: ``FLOOR`` spread evenly, the rest by demand; sums to 1."""
    n = len(demands)
    total = sum(demands)
    if total <= 0:
        return [1.0 / n] * n
    return [FLOOR / n + (1 - FLOOR) * d / total for d in demands]


def apportion(total: int, fractions: list[float]) -> list[int]:
    """``total`` whole units split by ``fractions`` (largest remainders; ties to the lower index):
    the parts sum to ``total`` and each is within 1 of its exact quota."""
    quotas = [total * f for f in fractions]
    parts = [math.floor(q) for q in quotas]
    left = total - sum(parts)
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - parts[i]), i))
    for i in order[:max(0, left)]:
        parts[i] += 1
    return parts
