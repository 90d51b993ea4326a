"""The tensor-parallel layout stated on whole mapped tensors: the reference the loader's
slice-by-slice reads (engine_workers/model/loading/sharding/slices.py, checkpoint.py) are tested against.

The loader never slices whole tensors (each rank reads only its spans); this independent
statement of the same shard, rule by rule on the mapped names, is what makes the equality test
mean something. TensorParallelError for a name no rule covers (a new family must say how it splits).
"""

from __future__ import annotations

import torch

from engine_workers.model.loading.sharding.layout import RankLayout, TensorParallelError
from engine_workers.model.loading.sharding.shard import _ONCE_TAILS, _VOCAB, _once
from engine_workers.model.models.spec import ModelSpec

_REPLICATED_SUFFIXES = ("norm.weight", "router.weight", "router.bias", "router.correction")


def _gated_rows(w: torch.Tensor, inter: int, rows: tuple[int, int], dim: int, interleaved: bool) -> torch.Tensor:
    """Rows ``rows`` of both halves of a fused gate/up along ``dim``: gate rows then up rows, or
    gpt-oss's interleaved pairs (``2i`` gate, ``2i + 1`` up), which a contiguous range keeps paired."""
    i0, i1 = rows
    if interleaved:
        return w.narrow(dim, 2 * i0, 2 * (i1 - i0))
    return torch.cat([w.narrow(dim, i0, i1 - i0), w.narrow(dim, inter + i0, i1 - i0)], dim=dim)


def _vocab_rows(w: torch.Tensor, lay: RankLayout) -> torch.Tensor:
    v0, v1 = lay.vocab
    out = w.new_zeros((lay.vocab_local, *w.shape[1:]))
    out[: v1 - v0] = w[v0:v1]
    return out


def shard_state(state: dict[str, torch.Tensor], spec: ModelSpec, lay: RankLayout) -> dict[str, torch.Tensor]:
    """Rank ``lay``'s slice of every tensor of ``state`` (the loader's mapped names for ``spec``);
    the slices are copies."""
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
