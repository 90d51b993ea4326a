"""Chained block hashes for automatic prefix caching.

A full block's hash covers its parent's hash, its token ids and an extra key (model name plus an
optional per-tenant salt), so equal hashes mean equal *prefixes*, not merely equal blocks. Hashes
are 128-bit BLAKE2b: collisions are astronomically unlikely, and a hit is still verified against the
stored token ids before it is used (see ``BlockPool.lookup``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = b"lockgate-root-v1"


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else ROOT)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra: bytes = b"", known: Sequence[bytes] = ()
) -> list[bytes]:
    """Hashes of every *full* block of ``token_ids``. ``known`` (a prefix of the result computed
    earlier for the same tokens) is reused, so extending a sequence hashes only its new blocks."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    out = list(known)
    parent = out[-1] if out else None
    for start in range(len(out) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        out.append(parent)
    return out
