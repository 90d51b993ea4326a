"""A fixed pool of KV blocks with reference counts, an LRU free queue and a prefix-hash index.

Invariants:
* every block is either referenced (``ref_cnt > 0``) or in the free queue, never both;
* a block in the hash index holds exactly the tokens its hash covers, until it is evicted;
* the free queue is ordered least-recently-freed first: eviction takes the front. Blocks without a
  hash are put at the front (nothing to lose by reusing them), hashed ones at the back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class Block:
    __slots__ = ("block_id", "ref_cnt", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (unreferenced; cached ones included)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[Block] | None:
        """Take ``n`` blocks from the front of the free queue (evicting their cached contents).
        Returns ``None`` — taking nothing — when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        h = block.hash
        if h is not None and self._cached.get(h) == block.block_id:
            del self._cached[h]
        block.hash = None
        block.token_ids = None
        self.evictions += 1

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> Block | None:
        """The cached block for this hash, if its stored tokens really match; else ``None``."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks found by ``lookup`` (removing free ones from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block. Pass a sequence's blocks tail-first so that, among
        equally old blocks, a prefix outlives its continuation in the cache."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: Block, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under its prefix hash. A hash already held by another
        block (two sequences computed the same prefix concurrently) keeps the first one."""
        if not self.enable_caching or block.hash is not None:
            return
        if block_hash in self._cached:
            return
        block.hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block.block_id

    def reset_cache(self) -> int:
        """Forget every unreferenced cached block (e.g. after weights change). Returns how many."""
        n = 0
        for block_id in list(self._free):
            block = self.blocks[block_id]
            if block.hash is not None:
                self._evict(block)
                n += 1
        return n
