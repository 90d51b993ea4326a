"""One rank's share of a mapped checkpoint: the local :class:`ModelSpec` its modules are built from,
and the last touches on the slices it read (:mod:`engine_workers.model.loading.sharding.slices` says which
spans; :mod:`engine_workers.model.loading.sharding.layout` which heads and rows).

Works on the loader's mapped names (``layers.{i}.self_attn.qkv_proj.weight`` with q, k and v
fused, ``mlp.gate_up_proj`` with gate then up, MoE experts stacked ``[E, 2I, H]``), so every family
the loader maps is sharded by the same few rules. A rank's decoder is then the ordinary one with
fewer heads, a narrower MLP and a vocabulary slice; :mod:`engine_workers.model.loading.sharding.layers`
adds the communication.
"""

from __future__ import annotations

import dataclasses

import torch

from engine_workers.model.loading.sharding.layout import RankLayout
from engine_workers.model.models.spec import ModelSpec

# biases of row-split layers, added once after the partial sums meet (by rank 0)
_ONCE_TAILS = ("o_proj.bias", "down_proj.bias", "experts.down_bias", "shared.down_bias")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def local_spec(spec: ModelSpec, lay: RankLayout) -> ModelSpec:
    """The spec of the rank's modules: its heads, its MLP and expert rows, its vocabulary slice."""
    moe = spec.moe
    if moe is not None:
        moe = dataclasses.replace(moe, inter=lay.moe_inter[1] - lay.moe_inter[0],
                                  shared_inter=lay.shared_inter[1] - lay.shared_inter[0])
    return dataclasses.replace(
        spec, num_heads=lay.q_heads[1] - lay.q_heads[0], num_kv_heads=lay.kv_heads[1] - lay.kv_heads[0],
        intermediate_size=lay.inter[1] - lay.inter[0], vocab_size=lay.vocab_local, moe=moe)


def _once(t: torch.Tensor, lay: RankLayout) -> torch.Tensor:
    """A bias of a row-split layer: added after the partial sums meet, so by one rank only."""
    return t if lay.first else torch.zeros_like(t)


def finish_local(state: dict[str, torch.Tensor], lay: RankLayout) -> dict[str, torch.Tensor]:
    """A rank's mapped state read slice by slice (:mod:`engine_workers.model.loading.checkpoint`) made the
    rank's shard: its vocabulary rows zero-padded to ``vocab_local`` and the row-split layers'
    biases (read whole) zeroed off rank 0 (the tests' reference slicing, ``tests/engine_workers/model/
    tp_reference.py``, states the same shard on whole tensors)."""
    out = {}
    for name, w in state.items():
        if name in _VOCAB:
            pad = w.new_zeros((lay.vocab_local, *w.shape[1:]))
            pad[: w.shape[0]] = w
            w = pad
        elif ".".join(name.rsplit(".", 2)[-2:]) in _ONCE_TAILS:
            w = _once(w, lay)
        out[name] = w
    return out
