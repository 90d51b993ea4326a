"""Scheduler decisions: pure unit tests (no model)."""

from __future__ import annotations

from engine_workers.engine.scheduler import Scheduler, SchedulerConfig
from engine_workers.engine.sequence import SeqStatus, Sequence
from kv_store import KVCacheManager
from lockgate_types import SamplingParams


def make(num_blocks=64, block_size=4, max_seqs=8, budget=16):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_seqs, budget), kv), kv


def seq(name, n_prompt, priority=0.0):
    return Sequence(name, list(range(1, n_prompt + 1)), SamplingParams(temperature=0), priority=priority)


def run_step(s: Scheduler, sample_token=7):
    out = s.schedule()
    s.on_step_done(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.output_token_ids.append(sample_token)
    return out


def test_chunked_prefill_shares_the_budget_with_decodes():
    s, _ = make(budget=16)
    a = seq("a", 4)
    s.add(a)
    run_step(s)  # a prefilled, sampled its first token
    b = seq("b", 40)
    s.add(b)
    out = run_step(s)
    sizes = {i.seq.seq_id: i.num_new_tokens for i in out.scheduled}
    assert sizes == {"a": 1, "b": 15}  # a keeps decoding while b's prompt is chunked
    assert not [i for i in out.scheduled if i.seq is b][0].samples
    for _ in range(2):
        run_step(s)
    assert b.num_computed_tokens == 40 and len(b.output_token_ids) == 1


def test_admission_by_priority_then_fifo():
    s, _ = make(max_seqs=2, budget=64)
    for name, prio in [("low1", 2), ("high", 0), ("low2", 2), ("mid", 1)]:
        s.add(seq(name, 4, prio))
    out = s.schedule()
    assert [i.seq.seq_id for i in out.scheduled] == ["high", "mid"]
    assert [x.seq_id for x in s.waiting()] == ["low1", "low2"]


def test_preemption_picks_worst_priority_newest_and_resumes():
    s, kv = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq("a", 7, priority=0), seq("b", 7, priority=1)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 blocks each, pool full
    assert kv.num_free_blocks == 0
    run_step(s)  # each computes its 8th token: still 2 blocks
    run_step(s)  # a's 9th token needs a third block -> b (worse priority) is preempted
    assert s.num_preemptions >= 1 and b.status is SeqStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids  # output so far is kept
    assert a.status is SeqStatus.RUNNING


def test_head_of_line_waits_for_blocks():
    s, kv = make(num_blocks=3, block_size=4, budget=64)
    big, small = seq("big", 12, priority=0), seq("small", 2, priority=1)
    hog = seq("hog", 6, priority=0)
    s.add(hog)
    run_step(s)
    s.add(big)
    s.add(small)
    out = s.schedule()
    # big needs 3 blocks, only 1 free: nobody jumps it, small waits too (no starvation of big)
    assert [i.seq.seq_id for i in out.scheduled] == ["hog"]


def test_remove_frees_blocks_of_waiting_and_running():
    s, kv = make()
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    run_step(s)
    s.add(b)
    s.remove(a)
    s.remove(b)
    assert kv.num_free_blocks == kv.num_blocks and not s.has_unfinished()


def _full(margin: float | None, priorities=(2.0, 2.5)):
    kv = KVCacheManager(64, 4)
    s = Scheduler(SchedulerConfig(2, 16, priority_preemption_margin=margin), kv)
    running = [seq(f"r{i}", 4, priority=p) for i, p in enumerate(priorities)]
    for r in running:
        s.add(r)
    run_step(s)
    run_step(s)  # both decoding: every slot taken
    return s, running


def test_a_more_urgent_waiting_sequence_preempts_the_worst_running_one():
    s, (r0, r1) = _full(1.0)
    urgent = seq("p0", 4, priority=1.0)  # 1.5 more urgent than r1 (2.5): beyond the margin
    s.add(urgent)
    out = run_step(s)
    assert out.preempted == [r1]  # the worst priority (the newest among equals) goes
    assert {i.seq.seq_id for i in out.scheduled} == {"r0", "p0"}  # and p0 runs in the same step
    assert r1.status is SeqStatus.WAITING and r1.output_token_ids == [7, 7]  # its output is kept
    assert r1.num_computed_tokens == 0 and r1.num_priority_preemptions == 1


def test_no_priority_preemption_within_the_margin_or_when_off():
    s, _ = _full(1.0)
    s.add(seq("close", 4, priority=1.8))  # only 0.7 more urgent than the worst (2.5)
    assert run_step(s).preempted == []
    s, _ = _full(None)
    s.add(seq("p0", 4, priority=-10.0))
    assert run_step(s).preempted == []


def test_a_sequence_is_preempted_for_priority_a_bounded_number_of_times():
    s, (r0, r1) = _full(1.0, priorities=(2.0, 2.0))
    bumps = 0
    for i in range(6):  # a stream of urgent arrivals, each finishing at once
        urgent = seq(f"u{i}", 4, priority=0.0)
        s.add(urgent)
        out = run_step(s)
        bumps += len(out.preempted)
        s.remove(urgent)
        run_step(s)  # the preempted one is readmitted
    assert r0.num_priority_preemptions <= 2 and r1.num_priority_preemptions <= 2
    assert bumps == 4  # two each, then they keep their slots


def test_prefix_lookups_of_a_blocked_head_are_counted_once_at_admission():
    """The head of the waiting queue is looked up every step it waits for blocks; the prefix
    statistics count it once, when it is admitted (before, every blocked step counted again)."""
    s, kv = make(num_blocks=4, block_size=4, max_seqs=4, budget=64)
    a = seq("a", 14)  # 4 blocks with its first token: the whole pool
    s.add(a)
    run_step(s)
    b = seq("b", 6)
    s.add(b)
    for _ in range(3):  # b waits: no block free
        run_step(s)
    assert kv.stats.queries == 14
    s.remove(a)
    run_step(s)
    assert b.num_computed_tokens == 6
    assert kv.stats.queries == 14 + 6


def test_blocks_to_prefill_follows_a_chunked_prefill():
    s, kv = make(num_blocks=64, block_size=4, budget=8)
    a = seq("a", 30)  # 31 tokens with its first output: 8 blocks
    s.add(a)
    assert s.blocks_to_prefill() == 8
    seen = []
    for _ in range(10):
        run_step(s)
        seen.append((s.blocks_to_prefill(), kv.num_free_blocks))
        if a.output_token_ids:
            break
    # every step: blocks taken + blocks still to take stay the prompt's 8 (+ nothing counted twice)
    assert all(todo + (64 - free) in (8, 9) for todo, free in seen[:-1]), seen
    assert seen[-1][0] == 0


# -- output tokens are recomputed as decode rows (a resumed or preempted sequence) ----------------


def test_a_resumed_sequence_prefills_its_prompt_then_replays_its_outputs():
    s, _ = make(budget=64)
    r = seq("r", 10)
    r.output_token_ids.extend([21, 22, 23, 24, 25])  # resume_token_ids: sampled by an earlier run
    s.add(r)
    out = run_step(s)
    (item,) = out.scheduled
    # the chunk stops at the prompt's end although the budget holds all 15 tokens
    assert (item.num_new_tokens, item.samples, item.replay) == (10, False, False)
    assert r.output_token_ids == [21, 22, 23, 24, 25]
    (item,) = run_step(s).scheduled
    # the outputs as one replay chunk, which samples the next token after the last of them
    assert (item.num_new_tokens, item.samples, item.replay) == (5, True, True)
    assert r.output_token_ids[-1] == 7
    (item,) = run_step(s).scheduled
    assert (item.num_new_tokens, item.replay) == (1, False)  # from here on, plain decoding


def test_replay_is_chunked_by_the_budget_and_never_mixes_prompt_and_outputs():
    s, _ = make(budget=6)
    r = seq("r", 8)
    r.output_token_ids.extend(range(30, 39))  # 9 outputs
    s.add(r)
    steps = [(i.num_new_tokens, i.samples, i.replay) for i in (run_step(s).scheduled[0] for _ in range(4))]
    # 6 + 2 prompt tokens (never 4 outputs in with the last 2), then 6 + 3 outputs as replays
    assert steps == [(6, False, False), (2, False, False), (6, False, True), (3, True, True)]
    assert r.num_computed_tokens == 17 and len(r.output_token_ids) == 10


def test_replay_rows_are_capped_by_gathered_keys_where_configured():
    kv = KVCacheManager(64, 4)
    s = Scheduler(SchedulerConfig(8, 64, max_replay_keys=60), kv)
    r = seq("r", 4)
    r.output_token_ids.extend(range(30, 46))  # 16 outputs: 20 tokens, so 60 // 20 = 3 rows a step
    s.add(r)
    run_step(s)
    sizes = [run_step(s).scheduled[0].num_new_tokens for _ in range(2)]
    assert sizes == [3, 3]


def test_a_preempted_sequence_replays_its_outputs_when_readmitted():
    s, kv = make(num_blocks=64, block_size=4, budget=64)
    a = seq("a", 6)
    s.add(a)
    for _ in range(4):
        run_step(s)  # the prompt, then 3 decodes: 4 outputs, positions 0..8 computed
    kv.commit_computed("a", a.all_token_ids, a.num_computed_tokens, num_prompt_tokens=6)  # as the engine does
    s._preempt(a)
    # its two full blocks are cached (the second holds 2 prompt and 2 output positions, keyed as
    # such): readmitted, it takes them and replays the other 2 outputs
    (item,) = run_step(s).scheduled
    assert a.num_cached_tokens == 0 and (item.num_new_tokens, item.samples, item.replay) == (2, True, True)
    s._preempt(a)
    kv.pool.reset_cache()  # nothing cached: the prompt by prefill, then the 5 outputs replayed
    items = [run_step(s).scheduled[0] for _ in range(2)]
    assert [(i.num_new_tokens, i.samples, i.replay) for i in items] == [(6, False, False), (5, True, True)]
