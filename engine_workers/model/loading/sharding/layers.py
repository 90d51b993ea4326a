"""The communication of a tensor-parallel decoder, added around a rank's ordinary modules.

A rank's :class:`~engine_workers.model.models.llama.LlamaForPagedLM` is built from its local spec
(:mod:`engine_workers.model.loading.sharding.shard`): its QKV and gate/up projections are already the
column-split ones (each rank computes its own heads and its own intermediate rows), so what is
left is Megatron's two all-reduces per layer and the vocabulary's two ends:

* :class:`AllReduced` after the attention output projection and after the MLP (dense or MoE): each
  rank's partial sum over its heads / rows, summed across ranks; every rank then holds the same
  residual stream (gloo's all-reduce leaves identical bits on every rank).
* :class:`VocabParallelEmbedding`: each rank looks up the ids in its vocabulary range, zeros the
  others, and the rows are all-reduced (exactly one rank contributes each row).
* :class:`GatheredHead`: each rank's logits for its vocabulary range, gathered on rank 0 (the
  sampler's rank) and trimmed of the padding rows; the other ranks get an empty tensor.

Nothing here runs at ``--tensor-parallel-size 1``: the loader wraps only for a group of two or more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine_workers.model.loading.sharding.layout import RankLayout

if TYPE_CHECKING:
    from engine_workers.model.models.llama import LlamaForPagedLM


class AllReduced(nn.Module):
    """``inner``'s output summed over the ranks, in place."""

    def __init__(self, inner: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = self.inner(*args, **kwargs)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, lay: RankLayout) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.start, self.end = lay.vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight)
        out.mul_(mine.unsqueeze(1).to(out.dtype))
        dist.all_reduce(out)
        return out


class _TiedHead(nn.Module):
    """The head of a tied model: the rank's embedding slice as a linear layer."""

    def __init__(self, embed: VocabParallelEmbedding) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.embed.weight)


class GatheredHead(nn.Module):
    def __init__(self, inner: nn.Module, lay: RankLayout, vocab: int) -> None:
        super().__init__()
        self.inner, self.vocab, self.first = inner, vocab, lay.first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.inner(x).float().contiguous()
        if self.first:
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.gather(local, parts, dst=0)
            return torch.cat(parts, dim=-1)[..., : self.vocab]
        dist.gather(local, None, dst=0)
        return local[..., :0]


def parallelize(model: LlamaForPagedLM, lay: RankLayout, vocab: int) -> None:
    """Add the communication to rank ``lay``'s model (sharded and, where asked, packed already)."""
    from engine_workers.model.models.llama import MLP, DecoderLayer

    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        attn.o_proj = AllReduced(attn.o_proj)  # type: ignore[assignment]
        mlp = layer.mlp
        # the dense MLP keeps its class (the runner fuses its gating: LlamaForPagedLM.use_fused);
        # its last step is reduced: the down projection, or the whole fused w8a8 MLP
        if isinstance(mlp, MLP) and mlp.gated is not None:
            mlp.gated = AllReduced(mlp.gated)
        elif isinstance(mlp, MLP):
            mlp.down_proj = AllReduced(mlp.down_proj)  # type: ignore[assignment]
        else:  # MoE: routed plus shared experts, one all-reduce of their sum
            layer.mlp = AllReduced(mlp)  # type: ignore[assignment]
    assert isinstance(model.embed_tokens.weight, torch.Tensor)
    embed = VocabParallelEmbedding(model.embed_tokens.weight, lay)
    head = model.lm_head if model.lm_head is not None else _TiedHead(embed)
    model.embed_tokens = embed  # type: ignore[assignment]
    model.lm_head = GatheredHead(head, lay, vocab)
