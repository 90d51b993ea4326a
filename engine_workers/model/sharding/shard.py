"""One rank's share of a mapped checkpoint: the local :class:`ModelSpec` its modules are built from
and the slices of every weight (:mod:`engine_workers.model.sharding.layout` says which).

Works on the loader's mapped names (``layers.{i}.self_attn.qkv_proj.weight`` with q, k and v
fused, ``mlp.gate_up_proj`` with gate then up, MoE experts stacked ``[E, 2I, H]``), so every family
the loader maps is sharded by the same few rules. A rank's decoder is then the ordinary one with
fewer heads, a narrower MLP and a vocabulary slice; :mod:`engine_workers.model.sharding.layers`
adds the communication.
"""

from __future__ import annotations

import dataclasses

import torch

from engine_workers.model.sharding.layout import RankLayout, TensorParallelError
from engine_workers.model.spec import ModelSpec

_REPLICATED_SUFFIXES = ("norm.weight", "router.weight", "router.bias", "router.correction")
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


def _gated_rows(w: torch.Tensor, inter: int, rows: tuple[int, int], dim: int, interleaved: bool) -> torch.Tensor:
    """Rows ``rows`` of both halves of a fused gate/up along ``dim``: gate rows then up rows, or
    gpt-oss's interleaved pairs (``2i`` gate, ``2i + 1`` up), which a contiguous range keeps paired."""
    i0, i1 = rows
    if interleaved:
        return w.narrow(dim, 2 * i0, 2 * (i1 - i0))
    return torch.cat([w.narrow(dim, i0, i1 - i0), w.narrow(dim, inter + i0, i1 - i0)], dim=dim)


def _once(t: torch.Tensor, lay: RankLayout) -> torch.Tensor:
    """A bias of a row-split layer: added after the partial sums meet, so by one rank only."""
    return t if lay.first else torch.zeros_like(t)


def _vocab_rows(w: torch.Tensor, lay: RankLayout) -> torch.Tensor:
    v0, v1 = lay.vocab
    out = w.new_zeros((lay.vocab_local, *w.shape[1:]))
    out[: v1 - v0] = w[v0:v1]
    return out


def finish_local(state: dict[str, torch.Tensor], lay: RankLayout) -> dict[str, torch.Tensor]:
    """A rank's mapped state read slice by slice (:mod:`engine_workers.model.checkpoint`) made the
    rank's shard: its vocabulary rows zero-padded to ``vocab_local`` and the row-split layers'
    biases (read whole) zeroed off rank 0, as :func:`shard_state` leaves them."""
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


def shard_state(state: dict[str, torch.Tensor], spec: ModelSpec, lay: RankLayout) -> dict[str, torch.Tensor]:
    """Rank ``lay``'s slice of every tensor of ``state`` (the loader's mapped names for ``spec``);
    the slices are copies. The loader no longer slices whole tensors (each rank reads only its
    slices: :mod:`engine_workers.model.sharding.slices`); this is the layout stated on the mapped
    names, the reference those reads are tested against. TensorParallelError for a name no rule
    covers (a new family must say how it splits)."""
    d, hq, hkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    (q0, q1), (k0, k1) = lay.q_heads, lay.kv_heads
    moe = spec.moe
    swiglu = moe is not None and moe.activation == "swiglu_clamped"
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        leaf = name.rsplit(".", 2)
        tail = ".".join(leaf[-2:])
        if name in _VOCAB:
            t = _vocab_rows(w, lay)
        elif name.endswith(_REPLICATED_SUFFIXES):
            t = w
        elif tail in ("qkv_proj.weight", "qkv_proj.bias"):
            t = torch.cat([w[q0 * d : q1 * d], w[(hq + k0) * d : (hq + k1) * d],
                           w[(hq + hkv + k0) * d : (hq + hkv + k1) * d]])
        elif tail == "o_proj.weight":
            t = w[:, q0 * d : q1 * d]
        elif tail == "self_attn.sinks":
            t = w[q0:q1]
        elif tail in ("gate_up_proj.weight", "gate_up_proj.bias"):
            t = _gated_rows(w, spec.intermediate_size, lay.inter, 0, False)
        elif tail == "down_proj.weight":
            t = w[:, lay.inter[0] : lay.inter[1]]
        elif tail in _ONCE_TAILS:
            t = _once(w, lay)
        elif tail in ("experts.gate_up", "experts.gate_up_bias", "shared.gate_up", "shared.gate_up_bias"):
            assert moe is not None
            shared = tail.startswith("shared")
            inter, rows = (moe.shared_inter, lay.shared_inter) if shared else (moe.inter, lay.moe_inter)
            t = _gated_rows(w, inter, rows, 1, swiglu and not shared)
        elif tail in ("experts.down", "shared.down"):
            assert moe is not None
            rows = lay.shared_inter if tail.startswith("shared") else lay.moe_inter
            t = w[:, :, rows[0] : rows[1]]
        else:
            raise TensorParallelError(f"{spec.model_type}: no tensor-parallel rule splits weight {name!r}")
        out[name] = t.contiguous().clone()
    return out
