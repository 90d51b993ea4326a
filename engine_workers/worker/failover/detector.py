"""Which peers of this worker are alive, from their heartbeats alone: a sans-I/O core.

Workers run on different hosts, so nothing here looks at processes: a peer is what its
``WorkerStatus`` heartbeats say. Heartbeats in (:meth:`PeerDetector.observe`, with the local
monotonic time they arrived: hosts' wall clocks disagree, a heartbeat's ``ts`` is never compared
with ours), verdicts out (:meth:`PeerDetector.expired`: "peer X presumed dead at t").

Rules (docs/worker.md, "Failover"):

* **Detection time** ``detect_s``: a peer whose last heartbeat arrived more than ``detect_s`` ago is
  presumed dead (the default, 3 heartbeat periods, is in ``WorkerConfig.failover_detect_s``). A
  verdict is given once per death.
* **What counts as a peer**: one that beat ``min_beats`` times (default 1: a worker killed within
  its first heartbeat periods has requests in hand too).
* **A clean leave is not a death**: a peer whose last heartbeat said ``draining`` leaves the group
  itself (the group rebalances at once), so its silence is forgotten, not acted on.
* **Our own stall is not theirs**: when :meth:`expired` was not asked for longer than
  ``detect_s`` (this worker was paused), every peer's clock restarts instead. And no verdict while
  our own view of the status topic is behind: the topic has one partition, so once this worker
  reads back a heartbeat of its own, every heartbeat appended before it has been read too. While
  the last one of ours came back more than ``detect_s`` ago (we were paused and the topic's backlog
  is not read yet, our status reader lags, or we cannot reach the broker), a peer's silence may be
  ours, and nobody is presumed dead. (Off until the first of our own heartbeats comes back.)
* **Hysteresis**: a peer presumed dead (maybe only paused: SIGSTOP, a long GC, a network
  partition) stays out of the live set, and its claims do not count, until ``rejoin_beats``
  heartbeats arrive with gaps under ``detect_s``. Any heartbeat ends its current silence, though:
  silent again for ``detect_s``, it is reported again (a worker restarted under the same id may
  hold partitions and requests again before it counts as live). Its requests were taken over meanwhile; the
  takeover's higher ``attempt`` fences whatever the paused peer still sends (the edge drops it).

The live set and the claims feed the takeover's owner rule (:func:`owner`, rendezvous hashing of
the request's placement, :func:`affinity`):
every survivor that sees the same live set picks the same owner for a request, so exactly one
takes it; two survivors with different views may both take it (both exact; the edge dedupes by
seq) or neither (the group's rebalance then runs it, as before failover existed).

Pure: no asyncio, no bus. Not thread-safe (the worker's event loop owns it).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from bus import WorkerStatus

log = logging.getLogger(__name__)

FORGET_S = 600.0  # a peer reported dead and silent this long is forgotten (worker ids are often random per start)


@dataclass(frozen=True, slots=True)
class PeerDeath:
    """A peer presumed dead at ``at`` (local monotonic seconds), with its last heartbeat (its
    partitions, claims and numerics)."""

    worker_id: str
    at: float
    last: WorkerStatus


@dataclass(slots=True)
class _Peer:
    last: WorkerStatus
    seen_at: float  # local monotonic time its last heartbeat arrived
    beats: int  # heartbeats since it was first seen or last presumed dead, each within detect_s of the one before
    dead: bool = False  # presumed dead, not beating steadily again yet: out of the live set, its claims void
    reported: bool = False  # the verdict for its current silence was given


class PeerDetector:
    """See the module docstring. ``self_id``: this worker (never its own peer); ``model``: only
    heartbeats of workers serving it are watched (other models' workers share the status topic)."""

    def __init__(self, self_id: str, model: str, detect_s: float, min_beats: int = 1, rejoin_beats: int = 2) -> None:
        if not detect_s > 0:
            raise ValueError(f"detect_s must be > 0, got {detect_s!r}")
        if min_beats < 1 or rejoin_beats < 1:
            raise ValueError(f"min_beats and rejoin_beats must be >= 1, got {min_beats}, {rejoin_beats}")
        self.self_id = self_id
        self.model = model
        self.detect_s = detect_s
        self.min_beats = min_beats
        self.rejoin_beats = rejoin_beats
        self._peers: dict[str, _Peer] = {}
        self._checked: float | None = None  # when expired() last ran
        self._own_at: float | None = None  # when one of our own heartbeats last came back on the topic

    def observe(self, status: WorkerStatus, now: float) -> None:
        """A heartbeat arrived at ``now`` (local monotonic); our own ones too (they say how far our
        reading of the status topic has come)."""
        if status.model != self.model:
            return
        if status.worker_id == self.self_id:
            self._own_at = now
            return
        peer = self._peers.get(status.worker_id)
        if peer is None:
            self._peers[status.worker_id] = _Peer(status, now, 1)
            return
        # A gap of detect_s or more breaks the run of beats: a peer that beats, stalls, beats
        # again must show rejoin_beats steady beats before it counts as alive once more.
        peer.beats = peer.beats + 1 if now - peer.seen_at < self.detect_s else 1
        peer.last, peer.seen_at, peer.reported = status, now, False
        if peer.dead and peer.beats >= self.rejoin_beats:
            peer.dead = False
            log.info("worker %s: peer %s is beating again", self.self_id, status.worker_id)

    def expired(self, now: float) -> list[PeerDeath]:
        """The peers presumed dead since the last call (each once per death). A silent peer whose
        last heartbeat said it was draining is forgotten instead (it left the group itself)."""
        out: list[PeerDeath] = []
        if self._checked is not None and now - self._checked > self.detect_s:
            # We were the silent one (paused, a stalled event loop): the peers' heartbeats of that
            # time are still on their way to us. Restart every peer's clock rather than presume
            # the whole fleet dead.
            log.info("worker %s: no heartbeat check for %.2fs (this worker stalled); peers' clocks restarted",
                     self.self_id, now - self._checked)
            for peer in self._peers.values():
                if not peer.reported:
                    peer.seen_at = max(peer.seen_at, now)
        self._checked = now
        behind = self._own_at is not None and now - self._own_at > self.detect_s
        for wid, peer in list(self._peers.items()):
            if peer.reported and now - peer.seen_at > FORGET_S:
                del self._peers[wid]
                continue
            if peer.reported or now - peer.seen_at <= self.detect_s:
                continue
            if peer.last.draining or (peer.beats < self.min_beats and not peer.dead):
                del self._peers[wid]
                continue
            if behind:
                continue  # its heartbeats may be in the part of the topic we have not read yet
            # A peer presumed dead that beat again (a restarted incarnation, a paused one that ran
            # for a moment) and fell silent again is reported again: it may hold requests anew.
            peer.dead, peer.beats, peer.reported = True, 0, True
            out.append(PeerDeath(wid, peer.seen_at + self.detect_s, peer.last))
        return out

    def live(self) -> list[str]:
        """The live workers, this one included, sorted (peers not presumed dead, not draining)."""
        return sorted([self.self_id, *(w for w, p in self._peers.items() if not p.dead and not p.last.draining)])

    def numerics_of(self, worker_id: str) -> str | None:
        peer = self._peers.get(worker_id)
        return peer.last.numerics if peer is not None else None

    def claimed(self, request_id: str) -> bool:
        """Whether a live peer says it runs ``request_id`` as a takeover (a dead peer's claims do
        not count: its requests are free to be taken, or resumed by the partition's owner)."""
        return any(request_id in p.last.taken for p in self._peers.values() if not p.dead)

    def owned_elsewhere(self, topic: str, partition: int) -> bool:
        """Whether a live peer's last heartbeat lists the request partition as its own (the group
        has reassigned it: its owner reads it from the committed offset)."""
        return any(h.topic == topic and h.partition == partition
                   for p in self._peers.values() if not p.dead for h in p.last.holds)


def owner(request_id: str, candidates: Iterable[str]) -> str | None:
    """The worker among ``candidates`` that takes ``request_id`` over: highest rendezvous weight
    (blake2b of request id and worker id), so the choice spreads requests evenly and moves only the
    requests of a worker that joins or leaves. None when there is no candidate."""
    best: tuple[bytes, str] | None = None
    for wid in candidates:
        w = hashlib.blake2b(f"{request_id}\x00{wid}".encode(), digest_size=8).digest()
        if best is None or (w, wid) > best:
            best = (w, wid)
    return best[1] if best is not None else None


def affinity(request_id: str, record_key: bytes | None, topic: str, partition: int) -> str:
    """What the owner rule hashes for a taken-over request (docs/worker.md, "Failover"): the edge's
    placement, not the request alone. The edge keys a request record by its prefix key (tenant and
    shared prompt prefix: edge/admission/affinity.py) when it has one, and puts the requests of a
    prefix on one partition, spilling a hot prefix over a few: so the requests sharing a key and a
    partition go to one survivor together (its prefix cache serves the second re-prefill onward),
    and a spilled prefix stays spread as the edge spread it. A record keyed by its request id (no
    shareable prefix) or unkeyed: the request id, spread alone."""
    if record_key is None or record_key == request_id.encode():
        return request_id
    return f"{record_key.decode('utf-8', 'replace')}\x00{topic}\x00{partition}"


def takeover_candidates(live: Iterable[str], numerics: str, numerics_of: dict[str, str]) -> list[str]:
    """Who may take over a dead peer's request: the live workers whose numerics fingerprint equals
    the dead one's when any does (a takeover is byte-exact only between equal fingerprints), else
    every live worker (a mismatched takeover still serves the request; where its tokens differ
    from those already sent, the edge ends the stream with a retryable error)."""
    live = list(live)
    same = [w for w in live if numerics_of.get(w) == numerics]
    return same or live
