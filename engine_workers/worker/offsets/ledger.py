"""The worker's ledger: every request record it holds, from fetch to the commit of its offset.

A record is *held* from the moment the worker fetches it until its final reply (``Finished`` /
``Error``) is acknowledged, or its partition moves to another worker. Per held request the ledger
keeps a :class:`Job` (by engine id and by request id) and the counts the worker's admission and
status read off the jobs (requests in the engine, KV blocks reserved for prompts not yet started,
waiting/running per tier). Per partition, its :class:`OffsetTracker` turns "answered" into the
offset the group may commit: the low watermark (a record is finished when its final reply is
acknowledged).

Rebalance (the group consumer's callbacks are the worker's ``Aborts``, which drive these):

* :meth:`RequestLedger.on_revoked` — eager rebalance, phase 1: wait up to ``revoke_flush_s`` for
  final replies in flight on those partitions, then commit what is done there. Their requests keep
  running: the partitions may well come straight back.
* :meth:`RequestLedger.reassigned` — phase 2: returns the partitions revoked and not assigned
  again, the *lost* ones. The caller aborts their requests and publishes nothing more for them
  (synchronously, so no output or acknowledgement lands half-way), then
  :meth:`RequestLedger.forget_partitions` forgets their offsets (the new owner re-runs them from
  the committed offset). The ledger calls nothing outside itself.

Commits go only to partitions the consumer still owns; a failed commit is logged and retried with
the next one (the low watermark only moves forward).

Concurrency: not thread-safe. Owned by the worker's event loop; the engine thread never touches it
(its outputs reach the worker through ``call_soon_threadsafe``). Every method is synchronous except
:meth:`~RequestLedger.commit` and :meth:`~RequestLedger.on_revoked`, which await the bus while jobs
may change state. ``commit`` records only what the bus acknowledged (``OffsetTracker.committed``
only moves forward and skips partitions forgotten meanwhile); cancelled mid-way it records nothing,
so the offsets are committed again later or re-run by the new owner: never skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Set
from dataclasses import dataclass

from bus import BusError, Consumer, InferenceRequest, TopicPartition
from engine_workers.worker.intake.queue import NUM_TIERS, Pending
from engine_workers.worker.offsets.watermark import OffsetTracker
from tracing import Span

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Job:
    """One held request record and where it is: intake, engine, final reply in flight.
    ``admitted``/``started`` change only through the ledger, which keeps ``in_engine`` in step
    with them; the worker sets the other flags itself."""

    eid: str  # engine request id: unique per worker even when a request id comes back
    req: InferenceRequest
    tp: TopicPartition | None
    offset: int
    arrival: float  # wall clock: enqueued_at (fetch time when unset or in the future)
    prompt_blocks: int  # KV blocks the prompt (+1 token) needs
    aging_from: float = 0.0  # wall clock its aging counts from (intake.aging_start); 0: from arrival
    pending: Pending | None = None  # while in the intake
    admitted: bool = False  # handed to the engine, final output not seen yet
    started: bool = False  # first output seen (its KV is in the engine's free-block count)
    closing: bool = False  # final reply queued
    lost: bool = False  # partition revoked: publish nothing more
    expiring: bool = False  # aborted in the engine at its deadline: its final reply is Error(expired)
    # A dead peer's request taken over here (worker/failover): its record belongs to a partition
    # this worker does not own (``tp`` None: nothing to commit); listed in the heartbeat's claims
    # until its final reply is acknowledged.
    takeover: bool = False
    send_failures: int = 0  # earlier runs of this record whose replies could not be sent (send_failures.py)
    resume: tuple[int, ...] = ()
    span: Span | None = None  # the worker span, only when tracing is on (worker/spans.py)
    reply_queued_ns: int = 0  # when its final reply was queued (the reply send span's start)
    block_size: int = 0  # the engine's KV block size; 0 (tests): ``blocks`` is ``prompt_blocks``
    engine_add: int = 0  # the engine's number for its add command once applied (0: not yet)

    @property
    def order_time(self) -> float:
        """The instant the intake ages this request from."""
        return self.aging_from or self.arrival

    @property
    def blocks(self) -> int:
        """KV blocks the engine takes to start it: its prompt, the output tokens it resumes with
        (another worker's, ``resume``: prefilled with the prompt), and one for the first token."""
        if not self.block_size:
            return self.prompt_blocks
        return max(self.prompt_blocks, -(-(len(self.req.prompt_token_ids) + len(self.resume) + 1) // self.block_size))


class RequestLedger:
    """See the module docstring. ``consumer`` is set by the worker once it created the group
    consumer (no commit happens before)."""

    def __init__(self, worker_id: str, revoke_flush_s: float) -> None:
        self.worker_id = worker_id
        self.revoke_flush_s = revoke_flush_s
        self.consumer: Consumer | None = None
        self.offsets: OffsetTracker[TopicPartition] = OffsetTracker()
        self.in_engine = 0  # jobs admitted whose final output was not seen yet
        self._jobs: dict[str, Job] = {}
        self._by_rid: dict[str, set[str]] = {}
        self._revoking: set[TopicPartition] = set()
        self.assigned_at: dict[TopicPartition, float] = {}  # wall clock each owned partition came here

    # -- records and jobs -------------------------------------------------------------------------

    def fetched(self, tp: TopicPartition, offset: int) -> bool:
        """Hold a fetched record until its offset is finished. False when it is held already:
        re-delivered after a rebalance that left us the partition."""
        if self.offsets.seen(tp, offset):
            return False
        self.offsets.track(tp, offset)
        return True

    def add(self, job: Job) -> None:
        self._jobs[job.eid] = job
        self._by_rid.setdefault(job.req.request_id, set()).add(job.eid)

    def get(self, eid: str) -> Job | None:
        return self._jobs.get(eid)

    def of_request(self, request_id: str) -> list[Job]:
        """The jobs of ``request_id`` (a request id may come back while its first run is held)."""
        return [self._jobs[eid] for eid in self._by_rid.get(request_id, ())]

    def forget(self, job: Job) -> None:
        """Drop the job; its offset stays as it is (in flight unless finished)."""
        self._jobs.pop(job.eid, None)
        eids = self._by_rid.get(job.req.request_id)
        if eids is not None:
            eids.discard(job.eid)
            if not eids:
                del self._by_rid[job.req.request_id]

    def answered(self, job: Job) -> None:
        """The final reply is acknowledged: the record's offset may be committed."""
        self.forget(job)
        if not job.lost and job.tp is not None:
            self.offsets.finish(job.tp, job.offset)

    # -- engine accounting ------------------------------------------------------------------------

    def admitted(self, job: Job) -> None:
        job.admitted = True
        job.engine_add = 0
        self.in_engine += 1

    def started(self, job: Job) -> None:
        """First output seen."""
        job.started = True

    def left_engine(self, job: Job) -> None:
        if job.admitted:
            job.admitted = False
            self.in_engine -= 1

    def reserved_blocks(self, adds_applied: int) -> int:
        """KV blocks of admitted jobs that the engine's snapshot does not count yet: those whose
        add command it had not applied when the snapshot (``adds_applied``) was taken. From then
        on the snapshot counts them itself (``kv_blocks_to_prefill``, then its free blocks), chunk
        by chunk, so no block is counted both here and there (docs/worker.md, "Admission")."""
        return sum(j.blocks for j in self._jobs.values()
                   if j.admitted and (j.engine_add == 0 or j.engine_add > adds_applied))

    # -- counts -----------------------------------------------------------------------------------

    def taken(self) -> tuple[str, ...]:
        """The request ids held here as takeovers of a dead peer's requests (the heartbeat's claims)."""
        return tuple(sorted({j.req.request_id for j in self._jobs.values() if j.takeover and not j.lost}))

    def holds(self, owned: Set[TopicPartition], now: float, slack_s: float) -> dict[TopicPartition, int]:
        """Per owned partition, the record time (UNIX ms) from which every record not answered here
        lies: the oldest held request's enqueue time, else ``now``, less ``slack_s`` (records not
        fetched yet, producer clocks behind ours). What a survivor reads after this worker died."""
        since = {tp: now for tp in owned}
        for j in self._jobs.values():
            if j.tp in since and not j.lost:
                since[j.tp] = min(since[j.tp], j.arrival)
        return {tp: max(0, int((t - slack_s) * 1000)) for tp, t in since.items()}

    def busy(self) -> bool:
        """Something is running or has its final reply in flight."""
        return any(j.admitted or j.closing for j in self._jobs.values())

    def overdue(self, now: float) -> list[Job]:
        """Admitted jobs whose deadline (wall clock) is past ``now`` and that are not already
        ending (expiring, final reply queued, or their partition lost)."""
        return [j for j in self._jobs.values() if j.admitted and not (j.expiring or j.closing or j.lost)
                and j.req.deadline is not None and j.req.deadline <= now]

    def held_by_tier(self) -> tuple[int, ...]:
        """Per tier, the requests held here and not handed to the engine: in the intake, or waiting
        before it (reply topic check, resume lookup); not those whose final reply is on its way."""
        held = [0] * NUM_TIERS
        for j in self._jobs.values():
            if not (j.admitted or j.closing or j.lost):
                held[j.req.tier] += 1
        return tuple(held)

    def admitted_jobs(self) -> list[Job]:
        """The jobs in the engine (admitted, final output not seen yet)."""
        return [j for j in self._jobs.values() if j.admitted]

    def engine_waiting(self) -> int:
        return sum(1 for j in self._jobs.values() if j.admitted and not j.started)

    def queue_depth(self, intake_depth: tuple[int, ...]) -> tuple[int, ...]:
        """``intake_depth`` plus, per tier, the jobs admitted but not yet running."""
        depth = list(intake_depth)
        for j in self._jobs.values():
            if j.admitted and not j.started:
                depth[j.req.tier] += 1
        return tuple(depth)

    def running_by_tier(self) -> tuple[int, ...]:
        running = [0] * NUM_TIERS
        for j in self._jobs.values():
            if j.admitted and j.started:
                running[j.req.tier] += 1
        return tuple(running)

    # -- rebalance, commit ------------------------------------------------------------------------

    def on_partitions(self, tps: Set[TopicPartition]) -> list[Job]:
        return [j for j in self._jobs.values() if j.tp in tps]

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        """Eager rebalance, phase 1: commit what is done on these partitions (after a short wait
        for final replies in flight); their requests keep running until :meth:`on_assigned` says
        which partitions moved away."""
        self._revoking |= tps
        deadline = time.monotonic() + self.revoke_flush_s
        while time.monotonic() < deadline and any(j.closing and j.tp in tps for j in self._jobs.values()):
            await asyncio.sleep(0.01)
        await self.commit(tps)

    def reassigned(self, tps: set[TopicPartition]) -> set[TopicPartition]:
        """Eager rebalance, phase 2: ``tps`` are this worker's now. Returns the partitions revoked
        and not assigned again (lost): the caller stops their requests, then
        :meth:`forget_partitions`."""
        # One line a rebalance: which partitions this worker now reads (what an operator looks for
        # when requests seem stuck on one worker).
        log.info("worker %s assigned %d partitions: %s", self.worker_id, len(tps),
                 ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(tps)) or "none")
        lost, self._revoking = self._revoking - tps, set()
        now = time.time()
        self.assigned_at = {tp: self.assigned_at.get(tp, now) for tp in tps}
        return lost

    def forget_partitions(self, lost: Set[TopicPartition]) -> None:
        """Forget the offsets of partitions moved away (their requests already stopped)."""
        self.offsets.forget(lost)
        log.info("worker %s lost %d partitions; their requests were aborted here", self.worker_id, len(lost))

    async def commit(self, only: set[TopicPartition] | None = None) -> None:
        """Commit each owned partition's low watermark (``only``: just these partitions)."""
        offsets = self.offsets.committable()
        if only is not None:
            offsets = {tp: o for tp, o in offsets.items() if tp in only}
        if not offsets or self.consumer is None:
            return
        mine = self.consumer.assignment()
        offsets = {tp: o for tp, o in offsets.items() if tp in mine}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except BusError as exc:
            log.warning("worker %s: commit failed (%s); will retry", self.worker_id, exc)
        else:
            self.offsets.committed(offsets)
