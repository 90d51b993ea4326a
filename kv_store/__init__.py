"""Paged KV cache bookkeeping: block pool, prefix hashing, per-sequence block tables.

Pure Python (no torch, no asyncio): the engine's scheduler calls it to decide; the runner owns
the tensors (``ModelRunner.kv_caches`` in ``engine_workers.model.execution.runner``; only
``engine_workers.model.models.attention`` knows their layout) and only reads block ids from here.
"""

from kv_store.block_pool import Block, BlockPool
from kv_store.hashing import block_hashes, hash_block
from kv_store.manager import KVCacheManager, PrefixStats

__all__ = ["Block", "BlockPool", "KVCacheManager", "PrefixStats", "block_hashes", "hash_block"]
