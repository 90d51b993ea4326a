"""KVCacheManager (kv_store/manager.py) beyond the basics in test_block_pool.py: growth, tenant
salts, partial commits, caching off, and which cached blocks an allocation evicts."""

from __future__ import annotations

import pytest

from kv_store import KVCacheManager


def test_sizes_and_ids_follow_the_tables() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert kv.block_ids("a") == [] and kv.usage() == 0.0
    assert kv.allocate("a", 4)
    assert kv.allocate("a", 9)  # grows by the two blocks it lacks, keeping the first
    first = kv.block_ids("a")
    assert len(first) == 3 and len(set(first)) == 3
    assert kv.num_free_blocks == 7 and kv.usage() == pytest.approx(0.3)
    assert kv.allocate("a", 9) and kv.block_ids("a") == first  # already covered: nothing taken
    assert kv.free("a") == 3 and kv.num_free_blocks == 10


def test_a_cached_prefix_is_only_for_a_new_sequence() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    assert kv.allocate("a", 9)
    kv.commit_computed("a", tokens, 9)
    hit = kv.find_cached_prefix("b", tokens)
    assert hit.num_tokens == 8
    assert kv.allocate("c", 1)
    with pytest.raises(ValueError, match="already has blocks"):
        kv.allocate("c", 9, hit)


def test_tenant_salts_never_share_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    assert kv.allocate("a", 9)
    kv.commit_computed("a", tokens, 9, extra=b"tenant-a")
    assert kv.find_cached_prefix("b", tokens, extra=b"tenant-b").num_tokens == 0
    assert kv.find_cached_prefix("c", tokens).num_tokens == 0  # unsalted differs too
    assert kv.find_cached_prefix("d", tokens, extra=b"tenant-a").num_tokens == 8


def test_only_full_computed_blocks_are_committed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    assert kv.allocate("a", 12)
    kv.commit_computed("a", tokens, 6)  # one full block computed, the second half done
    assert kv.find_cached_prefix("b", tokens).num_tokens == 4
    kv.commit_computed("a", tokens, 12)
    assert kv.find_cached_prefix("c", tokens + [99]).num_tokens == 12
    kv.commit_computed("a", tokens, 4)  # going back commits nothing and breaks nothing
    assert kv.find_cached_prefix("d", tokens + [99]).num_tokens == 12


def test_caching_off_finds_nothing_and_counts_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    tokens = list(range(9))
    assert kv.allocate("a", 9)
    kv.commit_computed("a", tokens, 9)
    kv.free("a")
    assert kv.find_cached_prefix("b", tokens).num_tokens == 0
    assert kv.stats.queries == 0 and kv.stats.hit_rate == 0.0


def test_adopting_an_unreferenced_cached_prefix_uses_free_capacity() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    tokens = list(range(8))
    assert kv.allocate("a", 8)
    kv.commit_computed("a", tokens, 8)
    kv.free("a")
    hit = kv.find_cached_prefix("b", tokens + [50, 51, 52, 53, 54])
    assert hit.num_tokens == 8
    # 16 tokens: 4 blocks, 2 of them the cached prefix; 3 free in all -> refused, nothing changed
    assert not kv.allocate("b", 16, hit)
    assert "b" not in kv.tables and kv.num_free_blocks == 3
    assert kv.allocate("b", 12, hit)  # the 2 cached blocks + 1 new
    assert kv.num_free_blocks == 0 and kv.block_ids("b")[:2] == [blk.block_id for blk in hit.blocks]


def test_freeing_tail_first_keeps_the_shared_head_cached_longest() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    tokens = list(range(12))
    assert kv.allocate("a", 12)
    kv.commit_computed("a", tokens, 12)
    kv.free("a")  # all three blocks cached and free
    assert kv.allocate("x", 4)  # must evict one: the tail block, freed first
    assert kv.pool.evictions == 1
    assert kv.find_cached_prefix("b", tokens + [99]).num_tokens == 8


def test_blocks_holding_outputs_are_keyed_by_where_the_outputs_begin():
    """A prompt position's K/V come from a prefill, an output position's from a decode row: the
    same tokens, other last bits. So a block holding outputs hits only a sequence whose outputs
    begin at the same place (the same request resumed, or one that decoded the same tokens), and
    blocks of prompt only are shared as ever."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(1, 14))  # 13 tokens: a 6-token prompt, 7 outputs
    kv.find_cached_prefix("a", tokens, num_prompt_tokens=6)
    kv.allocate("a", 13)
    kv.commit_computed("a", tokens, 12, num_prompt_tokens=6)  # blocks [0,4) prompt, [4,8) both, [8,12) outputs
    assert kv.find_cached_prefix("same", tokens, num_prompt_tokens=6).num_tokens == 12
    # a prompt that contains a's outputs: only the block of prompt only is a's
    assert kv.find_cached_prefix("longer-prompt", tokens).num_tokens == 4
    assert kv.find_cached_prefix("longer-prompt2", tokens, num_prompt_tokens=10).num_tokens == 4
    assert kv.find_cached_prefix("shorter-prompt", tokens, num_prompt_tokens=4).num_tokens == 4
    # and the other way round: blocks a prompt filled are no decode rows' K/V
    shared = kv.find_cached_prefix("p", tokens + [77], num_prompt_tokens=14)
    assert shared.num_tokens == 4
    kv.allocate("p", 14, shared)
    kv.commit_computed("p", tokens + [77], 12, num_prompt_tokens=14)
    assert kv.find_cached_prefix("resumed", tokens, num_prompt_tokens=6).num_tokens == 12  # a's blocks
    kv.free("a")
    kv.pool.reset_cache()  # a's own blocks gone; the shared prompt block and p's are held
    assert kv.find_cached_prefix("resumed2", tokens, num_prompt_tokens=6).num_tokens == 4
    assert kv.find_cached_prefix("p-again", tokens + [77], num_prompt_tokens=14).num_tokens == 12
