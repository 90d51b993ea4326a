"""Which spans of a *checkpoint* tensor a tensor-parallel rank reads, as pure arithmetic.

The loader tags every tensor it takes from a checkpoint with a
:class:`~engine_workers.model.models.split.Split` (or None: the tensor is replicated and read whole); :func:`spans` turns the tag and the rank's
:class:`~engine_workers.model.loading.sharding.layout.RankLayout` into half-open index ranges along one
dimension. The reader (:mod:`engine_workers.model.loading.checkpoint`) reads just those ranges and
concatenates them in order, so a rank never holds a whole sharded tensor. The loader then maps the
pieces with the rank's *local* spec exactly as it maps whole tensors with the full one (fusing
q/k/v, gate/up, stacking experts); that commutes with the split because every split selects whole
heads, whole intermediate rows, or whole gate/up pairs, and the RoPE row reordering permutes rows
only within a head. The tests state the same layout on whole mapped tensors
(``tests/engine_workers/model/tp_reference.py``) and check that both give identical tensors.
"""

from __future__ import annotations

from engine_workers.model.loading.sharding.layout import RankLayout
from engine_workers.model.models.spec import ModelSpec
from engine_workers.model.models.split import Split


def _inter(split: Split, spec: ModelSpec, lay: RankLayout) -> tuple[int, tuple[int, int]]:
    """The block's whole intermediate size and the rank's range of it."""
    if split.block == "dense":
        return spec.intermediate_size, lay.inter
    if spec.moe is None:
        raise ValueError(f"{spec.model_type}: a {split.block} expert split on a model without experts")
    if split.block == "moe":
        return spec.moe.inter, lay.moe_inter
    return spec.moe.shared_inter, lay.shared_inter


def spans(split: Split, spec: ModelSpec, lay: RankLayout) -> tuple[tuple[int, int], ...]:
    """Rank ``lay``'s ranges along ``split.dim`` of a tensor of the full model ``spec``, in the order
    its local tensor holds them (a range may be empty: a rank past the end of a small vocabulary)."""
    d = spec.head_dim
    (q0, q1), (k0, k1) = lay.q_heads, lay.kv_heads
    kind = split.kind
    if kind == "heads":
        return ((q0 * d, q1 * d),)
    if kind == "kv":
        return ((k0 * d, k1 * d),)
    if kind == "qkv":
        hq, hkv = spec.num_heads, spec.num_kv_heads
        return ((q0 * d, q1 * d), ((hq + k0) * d, (hq + k1) * d), ((hq + hkv + k0) * d, (hq + hkv + k1) * d))
    if kind == "sinks":
        return ((q0, q1),)
    if kind == "vocab":
        return (lay.vocab,)
    size, (i0, i1) = _inter(split, spec, lay)
    if kind == "inter":
        return ((i0, i1),)
    if kind == "gated":
        return ((i0, i1), (size + i0, size + i1))
    return ((2 * i0, 2 * i1),)  # paired
