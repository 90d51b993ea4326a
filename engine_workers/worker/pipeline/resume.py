"""The pipeline's third stage. Resume, not restart: a request that another worker had started
continues from the last token it published, instead of from token 0.

Every token a worker publishes is durable on the request's reply topic, in the one partition its
request id keys to (``bus.partitioner.partition_for_key``), in order. A worker that takes over a
request (its partition moved here after a crash, or this worker restarted) reads that partition
from the request's enqueue time up to its end as of now (``Bus.read_partition``), folds the
replies into the contiguous token prefix ``0..k-1`` already published for it, as the edge
delivered it (fenced replies of a lower attempt left out: :func:`fold_progress`), and hands it to the engine as ``resume_token_ids``: one prefill of
prompt + prefix (a prefix-cache hit when this worker saw it), then decoding continues at seq k with
the request's seed, whose draw for position k depends only on (seed, k). The client sees no token
twice and none generated twice. A request whose final reply is already there (its worker died
between that reply and the commit) is committed without running.

Which requests are looked up: those enqueued before their partition was assigned to this worker:
only they can have been started elsewhere (``CLOCK_SLACK_S`` says what clocks that disagree cost).
Requests of one reply partition held together share one read. The read is bounded
(``READ_LIMIT`` records, ``READ_TIMEOUT_S``); where it fails or the history is longer, the request
restarts from 0 as before, which the edge's dedupe (and its check that overlapping token ids
agree) keeps exact.

Concurrency: event loop only. Owned tasks, one per reply partition being read; :meth:`stop`
cancels them (their requests stay uncommitted for the next owner). A held request whose partition
was revoked meanwhile (``job.lost``) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, replace

from bus import (
    Bus,
    BusError,
    DecodeError,
    Error,
    Finished,
    Message,
    TokenChunk,
    TopicPartition,
    decode,
    partition_for_key,
    replies_of,
)
from engine_workers.worker.offsets.ledger import Job
from engine_workers.worker.pipeline.handoff import Arrival, Stage

log = logging.getLogger(__name__)

# Enqueue stamps are the producer's clock, the assignment time ours. No slack after the assignment:
# every request enqueued later would pay a read of its reply partition before it could run (a
# fresh worker's first seconds of traffic). A producer clock ahead of ours by d makes a request
# enqueued up to d before the assignment skip the lookup: it then restarts from 0, which the edge's
# dedupe and token-id check keep exact; only the decode steps are spent again.
CLOCK_SLACK_S = 0.0
READ_LIMIT = 50_000  # records read from one reply partition for one lookup
READ_TIMEOUT_S = 5.0
CLAIM_POLL_S = 0.1  # how often a request claimed by a takeover is checked again


@dataclass(frozen=True, slots=True)
class Progress:
    """What a request's reply partition already holds for it: the contiguous output token ids from
    seq 0, and its final reply if one was published."""

    token_ids: tuple[int, ...] = ()
    final: Finished | Error | None = None
    attempt: int | None = None  # the highest attempt any reply for it carried (None: no reply)


def fold_progress(wanted: Set[str], replies: Iterable[Message]) -> dict[str, Progress]:
    """Fold replies (in partition order) into each wanted request's :class:`Progress`: the stream
    exactly as an edge reading the same partition has it. Chunks of several attempts may overlap;
    the prefix grows only contiguously (a chunk past a gap is left out, so a lost record shortens
    the prefix, never corrupts it). A reply of an attempt below the highest seen before it is left
    out, as the edge drops it (fencing): a paused worker that comes back after a takeover may
    publish tokens past the taker's, which no client received; a run resuming after them would
    leave a gap in every client's stream, and a fenced final reply would count as an answer the
    client never got. Pure."""
    tokens: dict[str, list[int]] = {}
    finals: dict[str, Finished | Error] = {}
    attempts: dict[str, int] = {}
    for m in replies:
        rid = getattr(m, "request_id", None)
        if not isinstance(rid, str) or rid not in wanted:
            continue
        attempt = getattr(m, "attempt", 0)
        if attempt < attempts.get(rid, attempt):
            continue  # fenced (edge/admission/router.py drops it too)
        attempts[rid] = attempt
        if isinstance(m, TokenChunk):
            have = tokens.setdefault(rid, [])
            if m.seq <= len(have) < m.seq + len(m.token_ids):
                have.extend(m.token_ids[len(have) - m.seq:])
        elif isinstance(m, (Finished, Error)):
            finals.setdefault(rid, m)
    return {rid: Progress(tuple(tokens.get(rid, ())), finals.get(rid), attempts[rid]) for rid in wanted if rid in attempts}


def decode_replies(values: Iterable[bytes]) -> list[Message]:
    """The replies carried by reply records, in order; undecodable records are skipped (they were
    dead-lettered or dropped by the edge when they were sent)."""
    out: list[Message] = []
    for v in values:
        try:
            out.extend(replies_of(decode(v)))
        except DecodeError:
            continue
    return out


class ResumeFinder:
    """``answered(job, final)``: a request already answered (commit it without running);
    ``assigned_at(tp)``: when the partition was assigned here (wall clock; None: not owned), for
    :meth:`needs_lookup`; ``claimed(job)``: another run of the request is held as a takeover of a
    dead peer's request (here or by a live peer: worker/failover), so this one waits until that
    claim is gone, then looks up what was published (finding its final reply, it runs nothing);
    ``partition_count(topic)``: a reply topic's partition count where known
    (the reply sender's cache; else the bus is asked); ``on_resumed(tokens)``: a request continues
    after ``tokens`` already published; ``next_stage``: the intake checks."""

    def __init__(self, bus: Bus, worker_id: str, answered: Callable[[Job, Finished | Error], None],
                 assigned_at: Callable[[TopicPartition], float | None],
                 partition_count: Callable[[str], int | None],
                 on_resumed: Callable[[int], None], next_stage: Stage,
                 claimed: Callable[[Job], bool] | None = None) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.answered = answered
        self.assigned_at = assigned_at
        self.partition_count = partition_count
        self.on_resumed = on_resumed
        self.next_stage = next_stage
        self.claimed = claimed if claimed is not None else (lambda _job: False)
        self._waiting: dict[tuple[str, int], list[Job]] = {}  # reply partition -> jobs not yet read for
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._waiting.values()) + len(self._tasks)

    def needs_lookup(self, job: Job) -> bool:
        """Only a request enqueued before its partition came to this worker can have been started
        by another one; a takeover always was."""
        if job.takeover:
            return True
        since = self.assigned_at(job.tp) if job.tp is not None else None
        return since is not None and job.req.enqueued_at <= since + CLOCK_SLACK_S

    def put(self, arrival: Arrival) -> None:
        """Hand ``arrival`` on now, or once its reply partition has been read."""
        if not self.needs_lookup(arrival.job) and not self.claimed(arrival.job):
            self.next_stage.put(arrival)
            return
        job = arrival.job
        task = asyncio.get_running_loop().create_task(self._hold(job), name=f"resume-{job.eid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _hold(self, job: Job) -> None:
        # A takeover runs it (or ran it): its final reply, once acknowledged, ends the claim and
        # the lookup below finds it. Nothing runs twice after the group's eventual rebalance.
        while self.claimed(job) and not job.lost:
            await asyncio.sleep(CLAIM_POLL_S)
        topic = job.req.reply_to
        try:
            count = self.partition_count(topic)
            if count is None:
                count = len(await self.bus.partitions_for(topic))
        except BusError as exc:  # the reply gate checked the topic; any failure here: restart from 0
            log.warning("worker %s: no history for %s (%s); it runs from the start", self.worker_id, job.eid, exc)
            self._release(job, None)
            return
        key = (topic, partition_for_key(job.req.request_id.encode(), count))
        batch = self._waiting.get(key)
        if batch is not None:
            batch.append(job)  # the read already scheduled for this partition serves it too
            return
        batch = self._waiting[key] = [job]
        await asyncio.sleep(0)  # let the rest of this fetch's requests join the batch
        del self._waiting[key]
        began = time.monotonic()
        found = await self._read(key, batch)
        for j in batch:
            progress = found.get(j.req.request_id) if found is not None else None
            if j.takeover:  # a failover's stall, part by part (docs/worker.md, "The stall")
                log.warning("worker %s: took over %s: history read in %.2fs, %d tokens published", self.worker_id,
                            j.eid, time.monotonic() - began, len(progress.token_ids) if progress is not None else 0)
            self._release(j, progress)

    async def _read(self, key: tuple[str, int], jobs: list[Job]) -> dict[str, Progress] | None:
        topic, partition = key
        since_ms = int((min(j.req.enqueued_at for j in jobs) - CLOCK_SLACK_S) * 1000)
        try:
            records = await self.bus.read_partition(topic, partition, max(0, since_ms), READ_LIMIT, READ_TIMEOUT_S)
        except (BusError, ValueError) as exc:
            log.warning("worker %s: reading %s[%d] for %d requests failed (%s); they run from the start",
                        self.worker_id, topic, partition, len(jobs), exc)
            return None
        if len(records) >= READ_LIMIT:
            log.warning("worker %s: %s[%d] holds more than %d records since the oldest of %d requests; "
                        "they run from the start", self.worker_id, topic, partition, READ_LIMIT, len(jobs))
            return None
        return fold_progress({j.req.request_id for j in jobs}, decode_replies(r.value for r in records))

    def _release(self, job: Job, progress: Progress | None) -> None:
        if job.lost:
            return  # its partition was revoked meanwhile: the new owner has it
        if progress is not None and progress.final is not None:
            self.answered(job, progress.final)
            return
        seen = progress.attempt if progress is not None else None
        if job.takeover or seen is not None:
            # Fencing: this run replies with an attempt above every one published for the request,
            # so the edge drops whatever an earlier run (a paused worker that comes back) still sends.
            job.req = replace(job.req, attempt=max(job.req.attempt, seen if seen is not None else 0) + 1)
        if progress is not None and progress.token_ids:
            if len(progress.token_ids) >= job.req.sampling.max_tokens:
                # Every token was sent but not the final reply: nothing to generate; the engine would
                # refuse a resume at max_tokens, so the request runs from the start (all deduped).
                log.info("worker %s: %s had all its tokens published; re-running it for its final reply",
                         self.worker_id, job.eid)
            else:
                job.resume = progress.token_ids
                self.on_resumed(len(progress.token_ids))
        self.next_stage.put(Arrival(job, waited=True))

    async def stop(self) -> None:
        """Cancel the lookups in flight; their requests stay uncommitted. Idempotent."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._waiting.clear()
