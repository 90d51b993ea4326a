"""Block pool, hashing and the KV manager: pure unit tests."""

from __future__ import annotations

import pytest

from kv_store import BlockPool, KVCacheManager, block_hashes, hash_block


def test_allocate_all_or_nothing_and_free_returns_blocks():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a is not None and pool.num_free == 1
    assert pool.allocate(2) is None and pool.num_free == 1  # nothing taken
    pool.free(a)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a[:1])


def test_chained_hash_depends_on_parent_and_extra():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(None, [1, 2], b"tenant-a") != hash_block(None, [1, 2], b"tenant-b")
    assert block_hashes([1, 2, 3, 4, 5], 2) == [h1, hash_block(h1, [3, 4])]  # partial block not hashed
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1], 0)


def test_cached_blocks_are_reused_verified_and_evicted_lru():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    h = hash_block(None, [1, 2])
    pool.cache(b, h, [1, 2])
    pool.free([b])
    assert pool.lookup(h, [1, 2]) is b
    assert pool.lookup(h, [7, 7]) is None  # a hash hit is verified against the tokens
    # Uncached free blocks are handed out before cached ones.
    fresh = pool.allocate(2)
    assert b not in fresh and pool.lookup(h, [1, 2]) is b
    (again,) = pool.allocate(1)  # only the cached block is left: it is evicted
    assert again is b and pool.lookup(h, [1, 2]) is None and pool.evictions == 1


def test_manager_prefix_sharing_refcounts_and_frees():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    assert kv.find_cached_prefix("a", tokens).num_tokens == 0
    assert kv.allocate("a", 10)
    kv.commit_computed("a", tokens, 10)
    hit = kv.find_cached_prefix("b", tokens[:8] + [99, 98])
    assert hit.num_tokens == 8  # two full blocks shared
    assert kv.allocate("b", 10, hit)
    assert kv.tables["b"][:2] == kv.tables["a"][:2]
    assert all(blk.ref_cnt == 2 for blk in kv.tables["a"][:2])
    assert kv.num_free_blocks == 8 - 3 - 1
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8
    assert kv.free("b") == 0  # idempotent


def test_manager_leaves_one_token_to_compute_and_counts_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    assert kv.allocate("a", 8)
    kv.commit_computed("a", tokens, 8)
    kv.free("a")
    hit = kv.find_cached_prefix("b", tokens)
    assert hit.num_tokens == 4  # the last block is not taken: its last token must be computed
    assert kv.stats.queries == 8 and kv.stats.hits == 4 and kv.stats.hit_rate == 0.5


def test_manager_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.allocate("a", 8)
    assert not kv.allocate("b", 1)
    assert "b" not in kv.tables and kv.num_free_blocks == 0
    assert not kv.allocate("a", 9)
    assert len(kv.tables["a"]) == 2
