"""Iteration-level scheduler: decides, each step, which tokens of which sequences run.

Pure (no torch, no asyncio). Every step builds one batch under two budgets — ``max_num_batched_tokens``
tokens and ``max_num_seqs`` sequences — out of:

1. running sequences, in admission order: one decode token each (plus its proposed speculative
   tokens, ``Sequence.spec_token_ids``, when they fit the token budget and free blocks: each counts
   as one token of the budget, and a sequence's speculation is dropped rather than preempting
   anyone for it), or the next chunk of a prompt still being prefilled (chunked prefill: a long
   prompt is split across steps, so it never stalls the decodes of everyone else);
2. then waiting sequences, best priority first (lower value = more urgent, FIFO among equals),
   each reusing its longest cached prefix.

**A sequence's output tokens are always computed as decode rows** (the bit-exactness of a resume):
a sequence that arrives with output tokens already sampled (a resumed request, ``resume_token_ids``)
or gets back to the queue with them (preempted by recompute) first prefills its prompt (chunked
as usual; a chunk never crosses the prompt's end), then its output tokens go as *replay* chunks
(``ScheduledSeq.replay``; as many per step as the budget allows), each row attending as the decode
row of its own position, the way each of those tokens was fed when it was first sampled. The
prefill and decode attention paths sum in different orders (the last bits of a position's K/V and
output differ), so recomputing outputs by prefill would continue the request from slightly other
logits; this way every position is computed exactly as in the uninterrupted run. The prefix
cache keys blocks holding output positions by where the outputs begin (kv_store/hashing.py), so
a hit is K/V computed the same way.

When KV blocks run out for a running sequence, the scheduler preempts by recompute: the victim is the
running sequence with the worst priority, most recently admitted; its blocks are freed, its output so
far kept, and it re-enters the waiting queue (recomputing prompt + output when readmitted, mostly
from the prefix cache). No new sequence is admitted in a step that preempted.

**Priority preemption** (``priority_preemption_margin``, 1.0 by default = one tier; None = off):
when the best waiting sequence is more urgent than the worst running one by at least the margin in
tier (``Sequence.tier``, else its priority), and by its priority too, and it cannot be admitted,
because every sequence slot is taken or because the KV cache has no blocks for it, the worst
running sequence (worst priority, newest) is preempted by recompute and the waiting one admitted in
the same step. Guard against thrashing: the margin itself (a preemptor must be a whole tier more
urgent, so the victim, readmitted, cannot preempt it back), one such preemption per step, and a
sequence is preempted for priority at most ``MAX_PRIORITY_PREEMPTIONS`` times and only while it was
preempted fewer than ``MAX_PREEMPTIONS`` times in all (then it keeps its slot). **Recompute or
wait, by cost**: when a sequence of this step samples its last allowed token and so gives back a
slot (and, for the KV case, enough blocks) at the step's end, the waiting one is admitted next step
instead: one step of its TTFT against a victim's recompute.

**Memory-pressure preemption is bounded too**: the victim is chosen among the running sequences
preempted fewer than ``MAX_PREEMPTIONS`` times; when there is none, the sequence that needs a block
waits for one (skips the step) as long as some other sequence progresses in the step (and will
free blocks when it finishes); only when nothing at all would run is the cap ignored. **Recompute
or wait, by cost**: a victim whose recompute costs more than a whole step's token budget is spared,
and the needy sequence waits a step instead, when a sequence of this step is about to finish (its
blocks come back within the step).

**The step protects TPOT** (``schedule(token_budget)``): the engine passes the tokens one step may
batch so that it lasts no longer than the strictest time-per-output-token target among the running
decodes (``Sequence.tpot_slo_s``, from the step time it measures: ``step_model.py``). The budget
never drops below the running decodes plus ``MIN_PREFILL_TOKENS``, so prefills always progress.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from engine_workers.engine.sequence import SeqStatus, Sequence
from kv_store import KVCacheManager

MAX_PRIORITY_PREEMPTIONS = 2
MAX_PREEMPTIONS = 4  # memory-pressure preemptions a sequence undergoes before it is spared (see above)
MIN_PREFILL_TOKENS = 16  # of a TPOT-sized step, at least this many go to prefills


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # cap one prompt's chunk per step (0 = no cap)
    priority_preemption_margin: float | None = 1.0  # one tier; None: never preempt for priority
    # distinct LoRA adapters among the running sequences (the model's adapter slots); None = no cap
    max_loras: int | None = None
    # replay rows x context per step, at most (None: no cap): where decode rows attend over a
    # gathered, padded copy of their keys (SDPA; not the CPU paged kernel, which reads the cache
    # in place), every replayed row gathers its whole context, and a long resume in one step
    # would gather rows x context keys at once
    max_replay_keys: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    samples: bool  # True when this chunk reaches the end of the known tokens -> sample one token
    # speculative tokens verified after the decode token (num_new_tokens = 1 + num_spec): the
    # first num_spec of seq.spec_token_ids; the engine rolls back what the model rejects
    num_spec: int = 0
    # the chunk recomputes output tokens sampled before (a resumed or preempted sequence), more
    # than one: each row attends as the decode row of its own position (see the module docstring)
    replay: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _replays(seq: Sequence, start: int, n: int) -> bool:
    """Whether the chunk of ``n`` tokens from ``start`` is a replay: output positions, more than
    one (a single one is a plain decode row anyway, and keeps the step eligible for CUDA graphs)."""
    return start >= seq.num_prompt_tokens and n > 1 and start + n <= seq.num_tokens


def _rank(seq: Sequence) -> float:
    """What priority preemption compares: the tier when the caller set one, else the priority."""
    return float(seq.tier) if seq.tier is not None else seq.priority


class Scheduler:
    """Not thread-safe: owned by the engine's step loop."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self._waiting: list[tuple[float, int, Sequence]] = []  # heap; aborted entries are skipped
        self._waiting_ids: set[str] = set()
        self.running: list[Sequence] = []
        self._order = itertools.count()
        self.num_preemptions = 0

    # -- queue management ----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting_ids)

    def waiting(self) -> list[Sequence]:
        return [s for _, _, s in sorted(self._waiting) if s.seq_id in self._waiting_ids]

    def add(self, seq: Sequence) -> None:
        if seq.arrival_order < 0:
            seq.arrival_order = next(self._order)
        seq.status = SeqStatus.WAITING
        self._waiting_ids.add(seq.seq_id)
        heapq.heappush(self._waiting, (seq.priority, seq.arrival_order, seq))

    def _peek_waiting(self) -> Sequence | None:
        while self._waiting:
            seq = self._waiting[0][2]
            if seq.seq_id in self._waiting_ids and seq.status is SeqStatus.WAITING:
                return seq
            heapq.heappop(self._waiting)
        return None

    def _pop_waiting(self) -> None:
        seq = heapq.heappop(self._waiting)[2]
        self._waiting_ids.discard(seq.seq_id)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish or abort)."""
        self._waiting_ids.discard(seq.seq_id)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.kv.free(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(self._waiting_ids)

    def blocks_to_prefill(self) -> int:
        """KV blocks the sequences held here still have to take before each has computed all its
        known tokens (+1 for the first sampled one): waiting sequences (never admitted, or
        preempted) and running ones part-way through a chunked prefill. Free blocks minus this is
        what a new request can count on (the worker's admission reads it off the snapshot)."""
        kv, need = self.kv, 0
        for seq in self._unprefilled():
            need += max(0, kv.blocks_needed(seq.num_tokens + 1) - len(kv.tables.get(seq.seq_id, ())))
        return need

    def _unprefilled(self) -> list[Sequence]:
        waiting = {s.seq_id: s for _, _, s in self._waiting if s.seq_id in self._waiting_ids}
        return [*waiting.values(), *(s for s in self.running if s.num_computed_tokens < s.num_tokens - 1)]

    # -- the decision --------------------------------------------------------------------------

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.kv.free(victim.seq_id)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.add(victim)

    def _chunk(self, seq: Sequence, computed: int, budget: int) -> int:
        """How many of the sequence's not-yet-computed tokens fit this step: a chunk is all prompt
        or all output, never both (prompt positions prefill, output positions replay as decodes)."""
        end = seq.num_prompt_tokens if computed < seq.num_prompt_tokens else seq.num_tokens
        n = min(end - computed, budget)
        if computed >= seq.num_prompt_tokens and self.config.max_replay_keys is not None:
            n = min(n, max(1, self.config.max_replay_keys // seq.num_tokens))
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def tpot_target(self) -> float | None:
        """The strictest time-per-output-token target among the running sequences (None: none)."""
        targets = [s.tpot_slo_s for s in self.running if s.tpot_slo_s is not None]
        return min(targets) if targets else None

    def _memory_victim(self, seq: Sequence, scheduled: dict[str, ScheduledSeq]) -> Sequence | None:
        """Whom to preempt so that ``seq`` gets a block, or None: ``seq`` waits a step instead
        (see the module docstring, bounded preemption and recompute vs wait)."""
        key = lambda s: (s.priority, s.admit_order)  # noqa: E731 - worst priority, newest
        under = [s for s in self.running if s.num_preemptions < MAX_PREEMPTIONS]
        progresses = any(k != seq.seq_id for k in scheduled)
        if not under:
            return None if progresses else max(self.running, key=key)
        victim = max(under, key=key)
        if victim is not seq and progresses and victim.num_computed_tokens > self.config.max_num_batched_tokens \
                and self._ending(scheduled):
            return None  # a sequence ends in this step: waiting one step is cheaper than a recompute
        return victim

    @staticmethod
    def _ending(scheduled: dict[str, ScheduledSeq]) -> list[Sequence]:
        """The sequences of this step that sample their last allowed token (their slots and blocks
        come back at its end)."""
        return [i.seq for i in scheduled.values()
                if i.samples and len(i.seq.output_token_ids) + 1 >= i.seq.params.max_tokens]

    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        """This step's batch. ``token_budget``: at most this many tokens (the engine's TPOT-sized
        step), never below the running decodes + ``MIN_PREFILL_TOKENS``; None: the configured one."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if token_budget is not None:
            budget = min(budget, max(token_budget, len(self.running) + MIN_PREFILL_TOKENS))
        scheduled: dict[str, ScheduledSeq] = {}

        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            if n <= 0:
                continue
            num_spec = 0
            if seq.spec_token_ids and seq.num_computed_tokens + 1 == seq.num_tokens:
                num_spec = min(len(seq.spec_token_ids), budget - 1)
                # speculation only into free blocks: it never preempts another sequence
                if num_spec and not self.kv.allocate(seq.seq_id, seq.num_tokens + num_spec):
                    num_spec = 0
                n += num_spec
            while not self.kv.allocate(seq.seq_id, seq.num_computed_tokens + n):
                victim = self._memory_victim(seq, scheduled)
                if victim is None:
                    n = 0  # waits for a block this step
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim.seq_id in scheduled:  # give back the victim's share of this step
                    budget += scheduled.pop(victim.seq_id).num_new_tokens
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING or n == 0:
                continue
            samples = seq.num_computed_tokens + n - num_spec == seq.num_tokens
            scheduled[seq.seq_id] = ScheduledSeq(seq, n, samples, num_spec, _replays(seq, seq.num_computed_tokens, n))
            budget -= n

        if not out.preempted:
            bumped = self._priority_victim(scheduled)
            if bumped is not None:
                budget += self._bump(bumped, out, scheduled)
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                head = self._peek_waiting()
                if head is None:
                    break
                seq = head
                if not self._lora_fits(seq):
                    break  # head of line waits for an adapter slot, as it waits for blocks
                # Not counted in the prefix statistics until it is admitted: a head of line that
                # waits for blocks is looked up again every step, and counting each lookup
                # inflated queries and hits by the steps it waited.
                lookup = seq.params.uses_prefix_cache
                prefix = self.kv.find_cached_prefix(seq.seq_id, seq.all_token_ids, seq.cache_extra,
                                                    lookup=lookup, count=False,
                                                    num_prompt_tokens=seq.num_prompt_tokens)
                n = self._chunk(seq, prefix.num_tokens, budget)
                if not self.kv.allocate(seq.seq_id, prefix.num_tokens + n, prefix):
                    # The KV cache is the limit: a head more urgent than the worst running
                    # sequence by the margin takes that one's blocks (once per step, bounded).
                    need = self.kv.blocks_needed(prefix.num_tokens + n)
                    victim = None if bumped is not None else self._priority_victim(scheduled, need)
                    if victim is None:
                        break  # head of line waits for blocks; no lower-priority request jumps it
                    bumped = victim
                    budget += self._bump(victim, out, scheduled)
                    # the victim's blocks may have held part of the head's prefix: look it up again
                    prefix = self.kv.find_cached_prefix(seq.seq_id, seq.all_token_ids, seq.cache_extra,
                                                        lookup=lookup, count=False,
                                                        num_prompt_tokens=seq.num_prompt_tokens)
                    n = self._chunk(seq, prefix.num_tokens, budget)
                    if not self.kv.allocate(seq.seq_id, prefix.num_tokens + n, prefix):
                        break
                if lookup and self.kv.enable_prefix_caching:
                    self.kv.count_lookup(len(seq.all_token_ids), prefix.num_tokens)
                self._pop_waiting()
                seq.num_computed_tokens = prefix.num_tokens
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = prefix.num_tokens
                seq.status = SeqStatus.RUNNING
                seq.admit_order = next(self._order)
                self.running.append(seq)
                samples = prefix.num_tokens + n == seq.num_tokens
                scheduled[seq.seq_id] = ScheduledSeq(seq, n, samples, replay=_replays(seq, prefix.num_tokens, n))
                budget -= n

        out.scheduled = list(scheduled.values())
        return out

    def _lora_fits(self, seq: Sequence, without: Sequence | None = None) -> bool:
        """Whether admitting ``seq`` keeps the running set (less ``without``) within ``max_loras`` adapters."""
        cap = self.config.max_loras
        if cap is None or seq.lora is None:
            return True
        running = {s.lora for s in self.running if s.lora is not None and s is not without}
        return seq.lora in running or len(running) < cap

    def _bump(self, victim: Sequence, out: SchedulerOutput, scheduled: dict[str, ScheduledSeq]) -> int:
        """Preempt ``victim`` for priority; returns the tokens of this step it gives back."""
        self._preempt(victim)
        out.preempted.append(victim)
        return scheduled.pop(victim.seq_id).num_new_tokens if victim.seq_id in scheduled else 0

    def _priority_victim(self, scheduled: dict[str, ScheduledSeq], need_blocks: int | None = None) -> Sequence | None:
        """The running sequence to preempt for the best waiting one, or None (see the module
        docstring: slots full or, ``need_blocks`` given, no blocks for it, which the victim's then
        cover; a margin of urgency; a bounded number of times per sequence; not when a sequence
        of this step ends and makes the room)."""
        margin = self.config.priority_preemption_margin
        if margin is None or not self.running or (need_blocks is None and len(self.running) < self.config.max_num_seqs):
            return None
        head = self._peek_waiting()
        if head is None:
            return None
        candidates = [s for s in self.running if s.num_priority_preemptions < MAX_PRIORITY_PREEMPTIONS
                      and s.num_preemptions < MAX_PREEMPTIONS]
        if not candidates:
            return None
        # The margin is on the tier (the worker's ``Sequence.tier``; the priority itself where none
        # is set): aged priorities differ by a "tier step" for every aging period between two
        # arrivals, and preempting on them preempted within a tier by age alone, a chain of
        # recomputes under any backlog. The head must also be the more urgent by its priority, so
        # a lower-tier request that aged past it is not preempted for it.
        victim = max(candidates, key=lambda s: (_rank(s), s.priority, s.admit_order))
        if _rank(head) + margin > _rank(victim) or head.priority >= victim.priority:
            return None
        if not self._lora_fits(head, without=victim):
            return None  # it would still wait for an adapter slot: the victim's recompute would buy nothing
        held = lambda s: len(self.kv.tables.get(s.seq_id, ()))  # noqa: E731 - blocks a sequence holds
        if need_blocks is not None and held(victim) + self.kv.num_free_blocks < need_blocks:
            return None  # its blocks would not be enough: preempting it would only waste its work
        ending = self._ending(scheduled)
        if ending and (need_blocks is None or sum(map(held, ending)) + self.kv.num_free_blocks >= need_blocks):
            return None  # the room comes back at this step's end: waiting one step beats a recompute
        victim.num_priority_preemptions += 1
        return victim

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the runner executed ``out`` (before sampling is applied)."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
