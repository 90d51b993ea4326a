"""Per-sequence block tables over a :class:`BlockPool`, with automatic prefix caching.

The scheduler asks three things of it: how much of a new sequence is already cached
(:meth:`find_cached_prefix`), whether a sequence can grow by some tokens (:meth:`allocate`, which
takes blocks or takes nothing), and to let a sequence go (:meth:`free`). After the model has written
a step's K/V, :meth:`commit_computed` registers the sequence's newly full blocks in the prefix index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_store.block_pool import Block, BlockPool
from kv_store.hashing import block_hashes


@dataclass(slots=True)
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    blocks: tuple[Block, ...]
    num_tokens: int


class KVCacheManager:
    """Not thread-safe: owned by the engine's step loop."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_committed: dict[str, int] = {}  # blocks of the table registered in the index
        self.stats = PrefixStats()

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    # -- lifecycle -------------------------------------------------------------------------------

    def find_cached_prefix(self, seq_id: str, token_ids: Sequence[int], extra: bytes = b"",
                           lookup: bool = True, count: bool = True,
                           num_prompt_tokens: int | None = None) -> CachedPrefix:
        """The longest run of cached full blocks that prefixes ``token_ids``. At least one token
        is always left to compute (the model must produce logits for the last position).
        ``lookup=False``: none (the sequence must compute every row), though its hashes are kept,
        so the blocks it fills are still registered for others. ``count=False``: the lookup is
        left out of :attr:`stats` (a caller that may look the same sequence up again before it
        uses the answer counts it once, with :meth:`count_lookup`, when it does).
        ``num_prompt_tokens``: where the sequence's prompt ends and its outputs begin (None: all
        prompt); blocks holding outputs are keyed by it (kv_store/hashing.py), so pass the same
        value to :meth:`commit_computed`."""
        hashes = block_hashes(token_ids, self.block_size, extra, self._hashes.get(seq_id, ()), num_prompt_tokens)
        self._hashes[seq_id] = hashes
        if not self.enable_prefix_caching or not lookup:
            return CachedPrefix((), 0)
        max_blocks = (len(token_ids) - 1) // self.block_size
        found: list[Block] = []
        for i, h in enumerate(hashes[:max_blocks]):
            block = self.pool.lookup(h, token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block is None:
                break
            found.append(block)
        num_tokens = len(found) * self.block_size
        if count:
            self.count_lookup(len(token_ids), num_tokens)
        return CachedPrefix(tuple(found), num_tokens)

    def count_lookup(self, queried: int, hit: int) -> None:
        """Count one prefix lookup of ``queried`` tokens that found ``hit`` of them cached."""
        self.stats.queries += queried
        self.stats.hits += hit

    def allocate(self, seq_id: str, num_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        """Make the table of ``seq_id`` cover ``num_tokens`` tokens, first adopting ``prefix``
        (only for a sequence with no blocks yet). All or nothing: on ``False`` nothing changed."""
        table = self.tables.get(seq_id)
        if table is None:
            table = []
        elif prefix is not None and prefix.blocks:
            raise ValueError(f"sequence {seq_id} already has blocks; a cached prefix applies only to a new one")
        prefix_blocks = prefix.blocks if prefix is not None else ()
        have = len(table) + len(prefix_blocks)
        need_new = max(0, self.blocks_needed(num_tokens) - have)
        # Cached prefix blocks that nobody references sit in the free queue: adopting them uses
        # free capacity just like fresh blocks do.
        from_free = sum(1 for b in prefix_blocks if b.ref_cnt == 0)
        if need_new + from_free > self.pool.num_free:
            return False
        self.pool.touch(prefix_blocks)
        new = self.pool.allocate(need_new)
        assert new is not None  # checked above
        if seq_id not in self.tables:
            self.tables[seq_id] = table
            self._num_committed[seq_id] = len(prefix_blocks)
        table.extend(prefix_blocks)
        table.extend(new)
        return True

    def commit_computed(self, seq_id: str, token_ids: Sequence[int], num_computed: int, extra: bytes = b"",
                        num_prompt_tokens: int | None = None) -> None:
        """Register the blocks that ``num_computed`` tokens have filled in the prefix index
        (``num_prompt_tokens`` as for :meth:`find_cached_prefix`)."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(seq_id)
        if table is None:
            return
        full = min(num_computed // self.block_size, len(table))
        start = self._num_committed.get(seq_id, 0)
        if full <= start:
            return
        hashes = block_hashes(token_ids[: full * self.block_size], self.block_size, extra,
                              self._hashes.get(seq_id, ())[:full], num_prompt_tokens)
        self._hashes[seq_id] = hashes
        bs = self.block_size
        for i in range(start, full):
            self.pool.cache(table[i], hashes[i], token_ids[i * bs : (i + 1) * bs])
        self._num_committed[seq_id] = full

    def truncate(self, seq_id: str, num_tokens: int) -> int:
        """Give back the blocks of ``seq_id`` past the first ``num_tokens`` tokens (speculative
        positions that were rejected). Only never-registered tail blocks go: a block registered in
        the prefix index is full of computed tokens, so it lies within ``num_tokens`` whenever the
        caller keeps every computed token. Returns how many blocks were freed."""
        table = self.tables.get(seq_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return 0
        if keep < self._num_committed.get(seq_id, 0):
            raise ValueError(f"sequence {seq_id}: truncating to {num_tokens} tokens would drop registered blocks")
        tail = table[keep:]
        del table[keep:]
        self.pool.free(reversed(tail))
        return len(tail)

    def free(self, seq_id: str) -> int:
        """Release every block of ``seq_id`` (tail first). Returns how many were held. Idempotent."""
        table = self.tables.pop(seq_id, None)
        self._num_committed.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        if not table:
            return 0
        self.pool.free(reversed(table))
        return len(table)
