"""Fleet-wide key limits: how much of each API key's limits this edge may use, from the heartbeats
every edge publishes on ``<ns>.edges`` (docs/protocol.md, "Fleet-wide limits"). Pure and
synchronous: callers pass ``now`` (monotonic seconds); the async shell is
:mod:`edge.admission.fleetsync`.

Every edge publishes, each sync interval, an :class:`~bus.EdgeStatus` naming the keys with load on
it: attempted requests per second (``demand``, admitted or refused), streams in flight, and
``stream_demand`` (streams plus recent ``max_streams`` refusals). From the last heartbeat of every
live edge, its own included, an edge computes each key's split:

* **rate** (``requests_per_min``, ``tokens_per_min``): edge ``i`` gets the fraction
  ``FLOOR / n + (1 - FLOOR) * demand_i / sum(demand)`` (``1 / n`` while no edge has demand); its
  token buckets hold that fraction of the key's bucket and refill at that fraction of its rate.
  ``FLOOR`` keeps a little of every key on every edge, so an idle edge admits a first request,
  whose attempt then counts as demand at the next heartbeat.
* **concurrency** (``max_streams``): the key's ``max_streams`` apportioned over the edges by the
  same formula on ``stream_demand`` (largest remainders, ties by edge id), capped by what the
  other edges hold: ``min(alloc_i, max_streams - sum(streams_j, j != i))``, because a stream
  admitted before a rebalance cannot be taken back.

Invariants: every edge computes every split from the same published values (an edge uses its own
*published* load, not its live counters), so the fractions sum to 1 and the stream allocations to
``max_streams`` whenever the edges have read the same heartbeats; they differ only by what one
heartbeat interval changed (the tolerance, docs). Liveness is judged on the bus's clock: the heartbeat
topic has one partition, so reading our own heartbeat back means every earlier one has been read. A
peer is dead when ``stale_s`` of our own heartbeats have come back since its last one (or it said
``gone``); when our heartbeats do not come back (the bus slow or away) no peer expires, so no share
ever grows from silence, and after ``stale_s`` without one this edge's own view is *stale*: it admits
no request of a limited key (fail closed) until its heartbeats come back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from bus import EdgeStatus, KeyLoad
from edge.config import KeyEntry

FLOOR = 0.1  # the part of a key's limit spread evenly over the live edges (the rest follows demand)
DEMAND_TAU_S = 5.0  # time constant of the decayed demand counters
KEY_HEX = 16  # the key-hash prefix a heartbeat names (64 bits: collisions are negligible)
MAX_KEYS_PER_STATUS = 4096  # the most loaded keys one heartbeat lists (~100 bytes each)
MIN_DEMAND = 1e-3  # a key whose demand decayed below this and that holds no stream is left out


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

    __slots__ = ("loads", "heard_at")

    def __init__(self, loads: dict[str, KeyLoad], heard_at: float) -> None:
        self.loads = loads
        self.heard_at = heard_at


def key_id(key_hash: str) -> str:
    """The name of a key in a heartbeat: a prefix of its SHA-256 hex."""
    return key_hash[:KEY_HEX]


def limited(entry: KeyEntry) -> bool:
    """Whether a key has any limit the fleet must share (dev mode's key has none)."""
    return bool(entry.requests_per_min or entry.tokens_per_min or entry.max_streams)


class FleetLimits:
    """One edge's view of the fleet and its shares. ``instance`` must be unique per process (an
    edge id may be shared by ``--reuse-port`` processes). Not thread-safe; one event loop owns it."""

    def __init__(self, instance: str, stale_s: float) -> None:
        if not instance:
            raise ValueError("instance must be a non-empty id")
        if not stale_s > 0:
            raise ValueError(f"stale_s must be > 0, got {stale_s}")
        self.instance = instance
        self.stale_s = stale_s
        self._demand: dict[str, _Demand] = {}
        self._edges: dict[str, _Edge] = {}  # live edges by instance id, ours included once published
        self._echo_at: float | None = None  # when we last read our own heartbeat back
        self._seq = 0
        self._version = 0  # bumped whenever a split may change; keys the cache below
        self._cache: dict[tuple[str, int], tuple[int, Share]] = {}
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
        if st.edge_id == self.instance:
            self._echo_at = now
            self._expire(now)
            return
        if st.gone:
            if self._edges.pop(st.edge_id, None) is not None:
                self._version += 1
            return
        self._edges[st.edge_id] = _Edge({k.key: k for k in st.keys}, now)
        self._version += 1

    def _expire(self, now: float) -> None:
        dead = [e for e, v in self._edges.items() if e != self.instance and now - v.heard_at > self.stale_s]
        for e in dead:
            del self._edges[e]
        if dead:
            self._version += 1

    # --- publishing ---------------------------------------------------------------------------
    def status(self, streams: Mapping[str, int], now: float, ts: float) -> EdgeStatus:
        """The heartbeat to publish now; ``streams``: streams in flight per key hash. From here on
        this edge's splits use exactly these values, as the other edges will."""
        loads: list[KeyLoad] = []
        for h in set(self._demand) | set(streams):
            d = self._demand.get(h)
            demand = d.attempts.rate(now) if d is not None else 0.0
            refusals = d.stream_refusals.rate(now) * DEMAND_TAU_S if d is not None else 0.0
            held = streams.get(h, 0)
            if demand < MIN_DEMAND and held == 0:
                self._demand.pop(h, None)  # idle: forgotten (memory stays bounded by the active keys)
                continue
            loads.append(KeyLoad(key_id(h), round(demand, 4), held, round(held + refusals, 4)))
        self.truncated = len(loads) > MAX_KEYS_PER_STATUS
        if self.truncated:
            loads.sort(key=lambda k: (k.stream_demand, k.demand), reverse=True)
            del loads[MAX_KEYS_PER_STATUS:]
        self._seq += 1
        self._edges[self.instance] = _Edge({k.key: k for k in loads}, now)
        self._version += 1
        return EdgeStatus(self.instance, ts, self._seq, False, tuple(sorted(loads, key=lambda k: k.key)))

    def leaving(self, ts: float) -> EdgeStatus:
        """The last heartbeat of a stopping edge: the others drop it at once."""
        self._seq += 1
        return EdgeStatus(self.instance, ts, self._seq, True)

    # --- decisions ----------------------------------------------------------------------------
    def fresh(self, now: float) -> bool:
        """Our own heartbeat came back within ``stale_s``: the view is current enough to admit on."""
        return self._echo_at is not None and now - self._echo_at <= self.stale_s

    def live_edges(self) -> int:
        """Edges in the view, this one included (1 before anything was heard)."""
        return len(self._edges) + (self.instance not in self._edges)

    def share(self, entry: KeyEntry) -> Share:
        """This edge's part of ``entry``'s limits under the current view."""
        kid = key_id(entry.key_hash)
        ck = (kid, entry.max_streams)
        hit = self._cache.get(ck)
        if hit is not None and hit[0] == self._version:
            return hit[1]
        share = self._compute(kid, entry.max_streams)
        if len(self._cache) > 4 * MAX_KEYS_PER_STATUS:
            self._cache.clear()
        self._cache[ck] = (self._version, share)
        return share

    def _compute(self, kid: str, max_streams: int) -> Share:
        ids = sorted(set(self._edges) | {self.instance})
        none = KeyLoad(kid)
        loads = [self._edges[e].loads.get(kid, none) if e in self._edges else none for e in ids]
        me = ids.index(self.instance)
        rate = weights([k.demand for k in loads])[me]
        if max_streams == 0:
            return Share(rate, None)
        alloc = apportion(max_streams, weights([k.stream_demand for k in loads]))[me]
        others = sum(k.streams for i, k in enumerate(loads) if i != me)
        return Share(rate, max(0, min(alloc, max_streams - others)))


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
