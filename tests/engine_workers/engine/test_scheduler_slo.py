"""SLO-first scheduling decisions (issue #52): pure, no model. Priority preemption when the KV
cache is the limit, bounded memory-pressure preemption, recompute vs wait, the TPOT-sized step,
and the step-time line it is sized from."""

from __future__ import annotations

import pytest

from engine_workers.engine.config import EngineConfig
from engine_workers.engine.scheduler import (
    MAX_PREEMPTIONS,
    MAX_PRIORITY_PREEMPTIONS,
    MIN_PREFILL_TOKENS,
    Scheduler,
    SchedulerConfig,
)
from engine_workers.engine.sequence import SeqStatus, Sequence
from engine_workers.engine.step_model import StepLine, StepModel, fit
from kv_store import KVCacheManager
from lockgate_types import SamplingParams


def seq(name: str, n_prompt: int, priority: float = 0.0, max_tokens: int = 64, tpot: float | None = None) -> Sequence:
    return Sequence(name, list(range(1, n_prompt + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                    priority=priority, tpot_slo_s=tpot)


def run_step(s: Scheduler, budget: int | None = None):
    out = s.schedule(budget)
    s.on_step_done(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.output_token_ids.append(7)
    return out


def test_priority_preemption_compares_tiers_not_aged_priorities() -> None:
    """Two p1 sequences whose aged priorities differ by more than the margin (an older one waits):
    no preemption within a tier; a p0 head a tier more urgent preempts the p2 victim."""
    assert EngineConfig(model="m").priority_preemption_margin == 1.0  # on by default (docs/worker.md)
    kv = KVCacheManager(64, 4)
    s = Scheduler(SchedulerConfig(2, 64, priority_preemption_margin=1.0), kv)
    for name, prio in (("new1", 1.0), ("new2", 1.0)):
        x = seq(name, 4, priority=prio)
        x.tier = 1
        s.add(x)
    run_step(s)
    old = seq("old", 4, priority=-5.0)  # aged 6 periods longer, same tier
    old.tier = 1
    s.add(old)
    assert run_step(s).preempted == []
    s2 = Scheduler(SchedulerConfig(2, 64, priority_preemption_margin=1.0), KVCacheManager(64, 4))
    running = []
    for name, tier in (("a", 1), ("b", 2)):
        x = seq(name, 4, priority=float(tier))
        x.tier = tier
        s2.add(x)
        running.append(x)
    run_step(s2)
    urgent = seq("p0", 4, priority=0.0)
    urgent.tier = 0
    s2.add(urgent)
    assert run_step(s2).preempted == [running[1]]


def tiered(name: str, n_prompt: int, tier: int, max_tokens: int = 64) -> Sequence:
    x = seq(name, n_prompt, priority=float(tier), max_tokens=max_tokens)
    x.tier = tier
    return x


def test_by_default_a_p0_arrival_preempts_p2_when_slots_or_kv_are_full() -> None:
    """The defaults (no margin given): slots full of p2 work, a p0 head preempts the newest p2 and
    runs in the same step; KV full with slots free, likewise."""
    assert SchedulerConfig().priority_preemption_margin == 1.0
    s = Scheduler(SchedulerConfig(2, 64), KVCacheManager(64, 4))
    older, newer = tiered("p2a", 4, 2), tiered("p2b", 4, 2)
    s.add(older)
    s.add(newer)
    run_step(s)
    chat = tiered("chat", 4, 0)
    s.add(chat)
    out = run_step(s)
    assert out.preempted == [newer] and {i.seq.seq_id for i in out.scheduled} == {"p2a", "chat"}
    s = Scheduler(SchedulerConfig(8, 64), KVCacheManager(8, 4))
    batch = tiered("batch", 27, 2)  # 7 of the 8 blocks
    s.add(batch)
    run_step(s)
    chat = tiered("chat", 10, 0)  # 3 blocks, 1 free
    s.add(chat)
    out = run_step(s)
    assert out.preempted == [batch] and chat.status is SeqStatus.RUNNING


def test_a_sequence_is_never_preempted_more_than_the_bound() -> None:
    """One slot, a p2 sequence, a stream of p0 arrivals: it is preempted for priority
    MAX_PRIORITY_PREEMPTIONS times, then keeps its slot (the p0 waits for it); and one already
    preempted MAX_PREEMPTIONS times (e.g. for memory) is never a priority victim."""
    s = Scheduler(SchedulerConfig(1, 64), KVCacheManager(64, 4))
    batch = tiered("batch", 4, 2, max_tokens=40)
    s.add(batch)
    run_step(s)
    bumped = 0
    for i in range(6):
        chat = tiered(f"chat{i}", 4, 0, max_tokens=2)
        s.add(chat)
        for _ in range(60):
            bumped += len(run_step(s).preempted)
            if batch.status is SeqStatus.RUNNING and len(batch.output_token_ids) >= 40:
                s.remove(batch)
            if len(chat.output_token_ids) >= 2:
                s.remove(chat)
                break
        assert chat.status is SeqStatus.FINISHED
        run_step(s)  # the preempted one is readmitted (recomputed) before the next arrival
    assert bumped == MAX_PRIORITY_PREEMPTIONS == batch.num_priority_preemptions
    assert batch.num_preemptions <= MAX_PREEMPTIONS and len(batch.output_token_ids) == 40
    s = Scheduler(SchedulerConfig(1, 64), KVCacheManager(64, 4))
    worn = tiered("worn", 4, 2)
    s.add(worn)
    run_step(s)
    worn.num_preemptions = MAX_PREEMPTIONS  # as after four memory-pressure preemptions
    s.add(tiered("chat", 4, 0))
    assert run_step(s).preempted == [] and worn.status is SeqStatus.RUNNING


def test_the_urgent_one_waits_a_step_instead_of_a_recompute_when_room_comes_back() -> None:
    """Recompute vs wait: a running sequence samples its last token this step, so a slot (or its
    blocks) comes back at the step's end: no victim; the p0 runs next step."""
    s = Scheduler(SchedulerConfig(2, 64), KVCacheManager(64, 4))
    ending, batch = tiered("ending", 4, 2, max_tokens=2), tiered("batch", 4, 2)
    s.add(ending)
    s.add(batch)
    run_step(s)  # each has 1 token; ending samples its 2nd and last next step
    chat = tiered("chat", 4, 0)
    s.add(chat)
    out = run_step(s)
    assert out.preempted == [] and chat.status is SeqStatus.WAITING
    s.remove(ending)
    out = run_step(s)
    assert out.preempted == [] and chat.status is SeqStatus.RUNNING and batch.num_preemptions == 0
    kv = KVCacheManager(8, 4)
    s = Scheduler(SchedulerConfig(8, 64), kv)
    ending, batch = tiered("ending", 11, 2, max_tokens=2), tiered("batch", 15, 2)  # 3 + 4 blocks
    s.add(ending)
    s.add(batch)
    run_step(s)
    chat = tiered("chat", 10, 0)  # 3 blocks: 1 free + ending's 3 at the step's end
    s.add(chat)
    assert run_step(s).preempted == [] and chat.status is SeqStatus.WAITING
    s.remove(ending)
    assert run_step(s).preempted == [] and chat.status is SeqStatus.RUNNING


def test_no_priority_preemption_that_would_leave_the_head_waiting_for_an_adapter() -> None:
    """max_loras 1: a p0 head for adapter b preempts the p2 sequence of adapter a only when that
    frees the adapter slot (it was a's only user); else it would wait anyway, and nobody is bumped."""
    for users, preempted in ((1, 1), (2, 0)):
        s = Scheduler(SchedulerConfig(users, 64, max_loras=1), KVCacheManager(64, 4))
        for i in range(users):
            x = tiered(f"a{i}", 4, 2)
            x.lora = "a"
            s.add(x)
        run_step(s)
        chat = tiered("chat", 4, 0)
        chat.lora = "b"
        s.add(chat)
        assert len(run_step(s).preempted) == preempted
        assert (chat.status is SeqStatus.RUNNING) == bool(preempted)


def test_an_urgent_request_preempts_for_kv_blocks_with_slots_free() -> None:
    """Slots are free (8), the KV cache is not: a p0 head takes the blocks of the p2 sequence."""
    kv = KVCacheManager(8, 4)
    s = Scheduler(SchedulerConfig(8, 64, priority_preemption_margin=1.0), kv)
    batch = seq("batch", 27, priority=2.0)  # 7 blocks
    s.add(batch)
    run_step(s)
    urgent = seq("chat", 10, priority=0.0)  # 3 blocks: only 1 free
    s.add(urgent)
    out = run_step(s)
    assert out.preempted == [batch] and batch.status is SeqStatus.WAITING
    assert urgent.status is SeqStatus.RUNNING and [i.seq for i in out.scheduled] == [urgent]
    assert batch.output_token_ids == [7]  # its output is kept; recomputed when readmitted


def test_no_kv_preemption_within_the_margin_or_when_it_would_not_free_enough() -> None:
    kv = KVCacheManager(8, 4)
    s = Scheduler(SchedulerConfig(8, 64, priority_preemption_margin=1.0), kv)
    s.add(seq("a", 27, priority=1.5))
    run_step(s)
    s.add(seq("b", 10, priority=1.0))  # only 0.5 more urgent
    assert run_step(s).preempted == []
    kv = KVCacheManager(8, 4)
    s = Scheduler(SchedulerConfig(8, 64, priority_preemption_margin=1.0), kv)
    small, big = seq("small", 2, priority=2.0), seq("big", 20, priority=0.0)
    s.add(seq("hog", 22, priority=0.0))  # 6 blocks, as urgent as big: never a victim
    s.add(small)  # 1 block
    run_step(s)
    s.add(big)  # 6 blocks: small's one + the free one are not enough
    assert run_step(s).preempted == [] and small.status is SeqStatus.RUNNING


def test_memory_pressure_preemptions_are_bounded_per_sequence() -> None:
    """Two sequences growing into a cache too small for both: the newer is recomputed at most
    MAX_PREEMPTIONS times, then waits for blocks instead while the other progresses."""
    kv = KVCacheManager(6, 4)
    s = Scheduler(SchedulerConfig(4, 64), kv)
    a, b = seq("a", 8, max_tokens=12), seq("b", 8, max_tokens=14)
    s.add(a)
    s.add(b)
    for _ in range(400):
        if not s.has_unfinished():
            break
        run_step(s)
        for x in (a, b):
            if x.status is SeqStatus.RUNNING and len(x.output_token_ids) >= x.params.max_tokens:
                s.remove(x)
    assert not s.has_unfinished()
    assert len(a.output_token_ids) == 12 and len(b.output_token_ids) == 14
    assert max(a.num_preemptions, b.num_preemptions) <= MAX_PREEMPTIONS


def test_a_costly_victim_is_spared_when_a_sequence_ends_this_step() -> None:
    """Recompute vs wait: the victim holds more computed tokens than a step's budget, and another
    sequence samples its last token in this step: the needy sequence waits one step instead."""
    kv = KVCacheManager(11, 4)
    s = Scheduler(SchedulerConfig(4, 16), kv)
    long = seq("long", 31, priority=1.0)
    s.add(long)
    run_step(s)
    run_step(s)  # prefilled in two chunks: 31 computed > the 16-token budget, a costly recompute
    ending, needy = seq("ending", 3, max_tokens=2), seq("needy", 4)
    s.add(ending)
    s.add(needy)
    run_step(s)  # long 8 blocks, ending 1, needy 1: one free, which long's next token takes
    out = s.schedule()
    assert out.preempted == [] and long.status is SeqStatus.RUNNING  # spared
    assert needy.seq_id not in {i.seq.seq_id for i in out.scheduled}  # it waits this step
    assert any(i.seq is ending and i.samples for i in out.scheduled)  # ending's blocks come back
    s.on_step_done(out)
    s.remove(ending)
    out = s.schedule()  # next step: the block is there
    assert needy.seq_id in {i.seq.seq_id for i in out.scheduled}


def test_the_tpot_budget_caps_a_step_and_never_starves_prefills() -> None:
    kv = KVCacheManager(256, 4)
    s = Scheduler(SchedulerConfig(16, 512), kv)
    decodes = [seq(f"d{i}", 4, tpot=0.05) for i in range(4)]
    for d in decodes:
        s.add(d)
    run_step(s)
    assert s.tpot_target() == 0.05
    s.add(seq("long", 400))
    out = run_step(s, budget=40)
    assert out.num_batched_tokens == 40  # 4 decodes + a 36-token chunk, not 4 + 400
    out = run_step(s, budget=2)  # a budget below the decodes: the prefill still gets its share
    assert out.num_batched_tokens == len(s.running) + MIN_PREFILL_TOKENS  # 4 decodes + 17 of the prompt
    out = run_step(s, budget=None)
    assert out.num_batched_tokens > 40


def test_step_line_fits_and_sizes_a_step() -> None:
    m = StepModel(min_samples=4)
    assert m.budget(0.05) is None  # nothing measured: the configured budget stays
    for tokens in (8, 64, 256, 512, 8, 64, 256, 512):
        m.observe(tokens, 0.010 + 0.0001 * tokens)
    line = m.line()
    assert line is not None
    assert line.fixed_s == pytest.approx(0.010, rel=1e-6) and line.per_token_s == pytest.approx(0.0001, rel=1e-6)
    assert m.budget(0.05) == 400  # (50 - 10) ms / 0.1 ms per token
    assert StepLine(0.06, 0.001).tokens_within(0.05) == 0
    assert fit([(10, 0.1)] * 5) is None  # one size only: no slope to fit
    noisy = fit([(10, 0.2), (100, 0.1)])  # a negative slope (noise): flat at the mean
    assert noisy is not None and noisy.per_token_s == 0 and noisy.fixed_s == pytest.approx(0.15)


def test_the_engine_sizes_a_step_to_the_strictest_tpot_and_caps_the_damage_when_it_is_out_of_reach() -> None:
    from types import SimpleNamespace

    from engine_workers.engine.core import Engine

    kv = KVCacheManager(256, 4)
    sched = Scheduler(SchedulerConfig(64, 2048), kv)
    model = StepModel(min_samples=2)
    for tokens in (16, 1024):
        model.observe(tokens, 0.010 + 0.0001 * tokens)
    engine = SimpleNamespace(config=SimpleNamespace(tpot_budget=True), scheduler=sched, step_model=model)
    assert Engine._token_budget(engine) is None  # nothing running: the configured budget
    for i in range(4):
        sched.add(seq(f"chat{i}", 4, tpot=0.05))
        sched.add(seq(f"batch{i}", 4, tpot=0.25))
    run_step(sched)
    assert Engine._token_budget(engine) == 400  # 50 ms: (50 - 10) / 0.1 tokens, p0's target rules
    many = Scheduler(SchedulerConfig(1024, 2048), KVCacheManager(1024, 4))
    for i in range(600):  # 600 decodes alone take 70 ms > 50: the step may last 140 ms
        many.add(seq(f"d{i}", 1, tpot=0.05))
    run_step(many)
    engine.scheduler = many
    assert Engine._token_budget(engine) == 1300
    engine.config.tpot_budget = False
    assert Engine._token_budget(engine) is None
