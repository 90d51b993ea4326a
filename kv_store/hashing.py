"""Chained block hashes for automatic prefix caching.

A full block's hash covers its parent's hash, its token ids and an extra key (model name plus an
optional per-tenant salt), so equal hashes mean equal *prefixes*, not merely equal blocks. Hashes
are 128-bit BLAKE2b: collisions are astronomically unlikely, and a hit is still verified against the
stored token ids before it is used (see ``BlockPool.lookup``).

**How the K/V were computed is part of the key.** A sequence's prompt positions are computed by
prefill, its output positions (tokens it sampled, recomputed after a resume or a preemption too)
as decode rows of their own position (engine_workers/engine/scheduler.py): the two attention
paths sum in different orders, so the same tokens at the same positions can hold K/V that differ
in the last bits. A block holding output positions therefore carries where in it the outputs begin
(``outputs_from``, 0 for a block of outputs only): a hit returns K/V bit-identical to what
computing the block would give, whichever request wrote it. Blocks of prompt only hash as before,
so requests sharing a prompt prefix share its blocks; a later prompt that contains an earlier
request's output (a chat's next turn) does not reuse the blocks that output was decoded into.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = b"lockgate-root-v1"


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"",
               outputs_from: int | None = None) -> bytes:
    """``outputs_from``: the offset in the block where the sequence's output positions begin (see
    the module docstring); None: the block is all prompt."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else ROOT)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    if outputs_from is not None:
        h.update(b"outputs-from")
        h.update(outputs_from.to_bytes(4, "little"))
    return h.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra: bytes = b"", known: Sequence[bytes] = (),
    num_prompt_tokens: int | None = None,
) -> list[bytes]:
    """Hashes of every *full* block of ``token_ids``. ``known`` (a prefix of the result computed
    earlier for the same tokens and prompt length) is reused, so extending a sequence hashes only
    its new blocks. ``num_prompt_tokens``: the first this many are the prompt, the rest outputs
    (None: all prompt)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if num_prompt_tokens is not None and num_prompt_tokens < 0:
        raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
    out = list(known)
    parent = out[-1] if out else None
    for start in range(len(out) * block_size, len(token_ids) - block_size + 1, block_size):
        outputs_from = None
        if num_prompt_tokens is not None and num_prompt_tokens < start + block_size:
            outputs_from = max(num_prompt_tokens - start, 0)
        parent = hash_block(parent, token_ids[start : start + block_size], extra, outputs_from)
        out.append(parent)
    return out
