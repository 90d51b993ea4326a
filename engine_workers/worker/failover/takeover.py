"""Takeover: a dead peer's requests continue on the survivors within the detection time, not after
the consumer group's session timeout (docs/worker.md, "Failover").

The thin async shell around :class:`~engine_workers.worker.failover.detector.PeerDetector`:

* **watch** — read the status topic (group-less, from latest) and feed every heartbeat to the
  detector; every ``TICK_S`` ask it for the peers presumed dead.
* **take over** — for each partition the dead peer's last heartbeat listed (``holds``) and that no
  live worker owns yet (the group has not rebalanced), read the partition directly
  (``Bus.read_partition``: a group-less reader; no group membership, no commit) from the time the
  heartbeat gave, and hand every request this worker owns by the rule (:func:`owner`, rendezvous
  hashing of the edge's placement, :func:`affinity`, over the live workers of the dead peer's
  numerics, :func:`takeover_candidates`) to the
  pipeline's reply gate as a *takeover* job. The resume stage then rebuilds it from the tokens
  already published and bumps its ``attempt`` (fencing). Records arriving on the partition later
  (not yet started requests) are read again every ``TAIL_S`` until a live worker owns the
  partition, at most ``TAIL_FOR_S``.
* **self-fencing** — a live peer claiming (heartbeat ``taken``) a request this worker runs means
  this worker was presumed dead (it was paused): its run is stopped and its record waits in the
  resume stage until the claim ends, then is committed from the final reply the taker published.

A takeover job has no partition here (``tp`` None): its offset is the group's, committed by the
partition's eventual owner, which finds the taker's claim, waits for it, and then the final reply
(resume stage): nothing runs twice.

Concurrency: event loop only; owns its tasks (:meth:`start`/:meth:`stop`); the read tasks are
bounded by the dead peers' partitions.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from bus import (
    Bus,
    BusError,
    Consumer,
    DecodeError,
    InferenceRequest,
    PartitionHold,
    Record,
    TopicPartition,
    WorkerStatus,
    decode,
)
from engine_workers.worker.failover.detector import PeerDeath, PeerDetector, affinity, owner, takeover_candidates
from engine_workers.worker.offsets.ledger import Job, RequestLedger
from engine_workers.worker.pipeline.handoff import Arrival, Serving, Stage

log = logging.getLogger(__name__)

TICK_S = 0.025  # how often the detector is asked at least (adds at most this to the detection time)
STATUS_POLL_MS = 25  # a status fetch's longest wait: records arriving end it at once
PREPARE_S = 10.0  # the reader's warm-up at start (connections, leaders of the request topics), at most
TAIL_S = 0.5  # a dead peer's partition is read again this often until the group reassigns it
TAIL_FOR_S = 120.0  # ... at most this long (the session timeout is far shorter)
READ_LIMIT = 20_000
READ_TIMEOUT_S = 5.0
LEFT_TO_OTHERS = 10_000  # records of dead peers' partitions that fell to another survivor, kept (oldest dropped)


@dataclass(frozen=True, slots=True)
class TakeoverConfig:
    """``detect_s``: the detection time; ``block_size``: the engine's KV block size (a job's
    blocks); ``request_topics``: the model's request topics (a dead peer's partitions are read
    from them: the bus's reader is prepared for them at start)."""

    worker_id: str
    model: str
    status_topic: str
    detect_s: float
    numerics: str
    block_size: int
    request_topics: tuple[str, ...] = ()


def claimed(detector: PeerDetector, ledger: RequestLedger, job: Job) -> bool:
    """The resume stage's claim check: another run of ``job``'s request is a takeover, held here or
    claimed by a live peer (a takeover itself is never held by a claim)."""
    if job.takeover:
        return False
    rid = job.req.request_id
    return detector.claimed(rid) or any(j.takeover and j is not job for j in ledger.of_request(rid))


class Takeover:
    """See the module docstring. ``next_stage``: the pipeline's reply gate; ``resume``: the resume
    stage (a self-fenced record waits there for the taker's final reply); ``stop_run(job)``: stop a
    run here and publish nothing more of it (abort in the engine, drop queued replies, or take it
    out of the intake); ``owned()``: the partitions this worker's consumer owns."""

    def __init__(self, bus: Bus, config: TakeoverConfig, detector: PeerDetector, ledger: RequestLedger,
                 serving: Serving, next_stage: Stage, resume: Stage, stop_run: Callable[[Job], None],
                 owned: Callable[[], set[TopicPartition]]) -> None:
        self.bus = bus
        self.config = config
        self.ledger = ledger
        self.serving = serving
        self.next_stage = next_stage
        self.resume = resume
        self.stop_run = stop_run
        self.owned = owned
        self.detector = detector
        self.taken_total = 0
        self.fenced_total = 0
        self._eids = itertools.count()
        # Requests of a dead peer that the owner rule gave to another survivor: if that one dies in
        # turn (its claims die with it), they are taken over again from here, at once, instead of
        # waiting for the group to reassign the first peer's partitions.
        self._left: dict[str, tuple[PeerDeath, Record]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._main: asyncio.Task | None = None
        self._consumer: Consumer | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._main is not None:
            return
        self._consumer = self.bus.consumer([self.config.status_topic], start_from="latest")
        await self._consumer.start()
        loop = asyncio.get_running_loop()
        self._main = loop.create_task(self._watch(), name=f"{self.config.worker_id}-failover")
        prepare = loop.create_task(self._prepare(), name=f"{self.config.worker_id}-failover-prepare")
        self._tasks.add(prepare)
        prepare.add_done_callback(self._tasks.discard)

    async def _prepare(self) -> None:
        """Warm the bus's partition reader now (connected, the request topics' leaders known), so
        the first takeover's read is a ListOffsets and a fetch on an open connection."""
        try:
            async with asyncio.timeout(PREPARE_S):
                await self.bus.prepare_reads(self.config.request_topics)
        except (TimeoutError, BusError) as exc:
            log.info("worker %s: partition reader not prepared (%r); the first takeover connects", self.config.worker_id,
                     exc)

    async def stop(self) -> None:
        """Cancel the watch and the reads in flight (their takeovers not handed on are left to the
        group's rebalance). Idempotent."""
        tasks = [t for t in (self._main, *self._tasks) if t is not None]
        self._main = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()

    # -- the watch --------------------------------------------------------------------------------

    async def _watch(self) -> None:
        assert self._consumer is not None
        while True:
            began = time.monotonic()
            try:
                records = await self._consumer.getmany(timeout_ms=STATUS_POLL_MS)
            except BusError as exc:
                log.warning("worker %s: status fetch failed (%s)", self.config.worker_id, exc)
                await asyncio.sleep(0.5)
                continue
            try:
                self._heard(records)
                for death in self.detector.expired(time.monotonic()):
                    self._on_death(death)
            except Exception:  # a bug here must not end the watch: failover would silently stop
                log.exception("worker %s: failover watch step failed", self.config.worker_id)
            # a fetch that waited its time out needs no further pause (a bus whose empty fetch
            # returns at once would spin without one)
            await asyncio.sleep(0 if records else max(0.0, TICK_S - (time.monotonic() - began)))

    def _heard(self, records: list[Record]) -> None:
        now = time.monotonic()
        for rec in records:
            try:
                msg = decode(rec.value)
            except DecodeError:
                continue
            if isinstance(msg, WorkerStatus):
                self.detector.observe(msg, now)
                if msg.taken and msg.worker_id != self.config.worker_id:
                    self._fence_self(msg.taken)

    def _on_death(self, death: PeerDeath) -> None:
        last = death.last
        log.warning("worker %s: peer %s presumed dead (silent for %.2fs); taking over its requests on %d partitions",
                    self.config.worker_id, death.worker_id, time.monotonic() - death.at + self.config.detect_s,
                    len(last.holds))
        if not self.serving.on:
            return
        # Two deaths one after the other: the requests the dead peer had taken over from an earlier
        # dead one (its claims) fall to the survivors again, by the same rule over the new live set.
        again = 0
        for rid in last.taken:
            left = self._left.pop(rid, None)
            if left is not None:
                again += self._take(*left)
        if last.taken:
            log.warning("worker %s: %d of the %d requests %s had taken over are taken over here", self.config.worker_id,
                        again, len(last.taken), death.worker_id)
        for hold in last.holds:
            task = asyncio.get_running_loop().create_task(self._take_partition(death, hold),
                                                          name=f"takeover-{hold.topic}-{hold.partition}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _reassigned(self, hold: PartitionHold) -> bool:
        return (self.detector.owned_elsewhere(hold.topic, hold.partition)
                or TopicPartition(hold.topic, hold.partition) in self.owned())

    async def _take_partition(self, death: PeerDeath, hold: PartitionHold) -> None:
        """Read ``hold``'s partition from its time and take this worker's share of its requests;
        again every ``TAIL_S`` for the records arriving later, until a live worker owns it."""
        since, after = hold.since_ms, -1  # after: the last offset handled
        verdict = time.monotonic()
        give_up = verdict + TAIL_FOR_S
        first = True
        while time.monotonic() < give_up and self.serving.on and not self._reassigned(hold):
            began, taken = time.monotonic(), 0
            try:
                records = await self.bus.read_partition(hold.topic, hold.partition, since, READ_LIMIT, READ_TIMEOUT_S)
            except (BusError, ValueError) as exc:
                log.warning("worker %s: reading %s[%d] for a takeover failed (%s); retrying",
                            self.config.worker_id, hold.topic, hold.partition, exc)
                records = []
            for rec in records:
                if rec.offset <= after:
                    continue
                after = rec.offset
                since = max(since, rec.timestamp_ms)
                try:
                    taken += self._take(death, rec)
                except Exception:  # one bad record must not end the partition's takeover
                    log.exception("worker %s: taking over %s[%d]@%d failed", self.config.worker_id, hold.topic,
                                  hold.partition, rec.offset)
            if first or taken:
                log.warning("worker %s: %s[%d] of %s: %d records read in %.3fs (%.3fs after the verdict), "
                            "%d requests taken over here", self.config.worker_id, hold.topic, hold.partition,
                            death.worker_id, len(records), time.monotonic() - began, time.monotonic() - verdict,
                            taken)
                first = False
            await asyncio.sleep(TAIL_S)

    def _take(self, death: PeerDeath, rec: Record) -> bool:
        """Take the request of one record of a dead peer's partition, if it falls to this worker;
        whether it did."""
        try:
            req = decode(rec.value)
        except DecodeError:
            return False  # the partition's owner dead-letters it
        if not isinstance(req, InferenceRequest) or req.model != self.config.model:
            return False
        rid = req.request_id
        if self.ledger.of_request(rid):
            return False  # this worker holds it already
        live = self.detector.live()
        numerics = {w: self.detector.numerics_of(w) or "" for w in live}
        numerics[self.config.worker_id] = self.config.numerics
        if (self.detector.claimed(rid)  # a live peer runs it already
                or owner(affinity(rid, rec.key, rec.topic, rec.partition),
                         takeover_candidates(live, death.last.numerics, numerics)) != self.config.worker_id):
            self._left[rid] = (death, rec)
            if len(self._left) > LEFT_TO_OTHERS:
                del self._left[next(iter(self._left))]
            return False
        self._left.pop(rid, None)
        now = time.time()
        arrival = req.enqueued_at if 0 < req.enqueued_at <= now else now
        job = Job(f"{rid}#t{next(self._eids)}", req, None, rec.offset, arrival,
                  -(-(len(req.prompt_token_ids) + 1) // self.config.block_size), takeover=True)
        self.ledger.add(job)
        self.taken_total += 1
        self.next_stage.put(Arrival(job, waited=True))
        return True

    # -- self-fencing -----------------------------------------------------------------------------

    def _fence_self(self, taken: tuple[str, ...]) -> None:
        """A live peer took over requests this worker still runs: this worker was presumed dead
        (paused past the detection time). Stop its runs; their records wait in the resume stage
        until the claim ends, then commit from the taker's final reply."""
        for rid in taken:
            for job in self.ledger.of_request(rid):
                # Only runs under way: a record held before the engine meets the claim in the resume stage.
                if job.takeover or job.lost or job.closing or job.tp is None or not (job.admitted or job.pending):
                    continue
                log.warning("worker %s: %s was taken over by a peer; stopping this run", self.config.worker_id, job.eid)
                self.stop_run(job)
                again = Job(f"{rid}#f{next(self._eids)}", job.req, job.tp, job.offset, job.arrival, job.blocks,
                            aging_from=job.aging_from)
                self.ledger.add(again)
                self.fenced_total += 1
                self.resume.put(Arrival(again, waited=True))
