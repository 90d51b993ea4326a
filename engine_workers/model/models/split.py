"""How a checkpoint tensor is cut for tensor parallelism: the tag the loader's name mapping puts on
every tensor it takes (None: replicated, read whole).

Pure data, importing nothing of ours, so the family mappings (``moe_family``, which ``spec``
imports) can tag their tensors without depending on :mod:`engine_workers.model.loading.sharding`, which
turns a tag and a rank's layout into index ranges (:func:`engine_workers.model.loading.sharding.slices.spans`).
"""

from __future__ import annotations

from dataclasses import dataclass

# kind -> what the ranges count along ``dim``
KINDS = frozenset({
    "heads",  # rows of the query heads: [q0 * head_dim, q1 * head_dim) (q_proj; o_proj's columns)
    "kv",  # rows of the KV heads (k_proj, v_proj)
    "qkv",  # a fused q, k, v projection (Phi-3): the three ranges above, in that order
    "sinks",  # one value per query head (gpt-oss's attention sinks)
    "inter",  # the block's intermediate rows [i0, i1) (gate, up; down's columns)
    "gated",  # a fused gate-then-up: [i0, i1) and [I + i0, I + i1)
    "paired",  # interleaved gate/up pairs (gpt-oss): [2 i0, 2 i1), each pair kept whole
    "vocab",  # the rank's rows of the real vocabulary [v0, v1) (embedding, LM head)
})
BLOCKS = frozenset({"dense", "moe", "shared"})  # whose intermediate size: the MLP's, each expert's, the shared


@dataclass(frozen=True, slots=True)
class Split:
    """A checkpoint tensor cut along ``dim`` as ``kind`` says (``block``: which MLP's rows)."""

    kind: str
    dim: int = 0
    block: str = "dense"

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.block not in BLOCKS or self.dim < 0:
            raise ValueError(f"not a split: {self.kind!r} along dim {self.dim} of block {self.block!r}")
