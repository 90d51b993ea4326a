"""Which part of every weight each tensor-parallel rank holds (Megatron's layout), as pure arithmetic.

* Attention is split by whole GQA groups: a rank holds some KV heads and exactly the query heads
  that read them, so no rank ever needs another rank's K/V and attention needs no communication.
  When the KV heads do not divide by the ranks the split is uneven, the first ranks taking one head
  more (SmolLM2-135M, 9 query heads in 3 groups of 3, at TP=2: rank 0 holds KV heads 0-1 with query
  heads 0-5, rank 1 KV head 2 with query heads 6-8). With fewer KV heads than ranks each KV head is
  replicated on ``tp / kv_heads`` ranks and its query heads are split evenly among them (vLLM's rule).
* The MLP's intermediate dimension and each MoE expert's are split into contiguous ranges (MoE is
  split *by tensor*: every rank holds a slice of every expert, the router is replicated, so the
  layout is the dense MLP's repeated per expert and the math is the same sums regrouped).
* The vocabulary is split into equal ranges of ``ceil(vocab / tp)`` rows, the last padded with zero
  rows, so the gathered logits are equal-sized pieces (trimmed back to ``vocab``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_workers.model.models.spec import ModelSpec


class TensorParallelError(RuntimeError):
    """A model that cannot be split as asked, or a tensor-parallel group that failed."""


def even_ranges(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``n`` items in ``parts`` contiguous ranges whose sizes differ by at most one, larger first."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append((start, start + size))
        start += size
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Rank ``rank`` of ``world``'s share of a model: half-open ranges of heads, rows and vocab."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]  # the dense MLP's intermediate rows
    moe_inter: tuple[int, int]  # each routed expert's
    shared_inter: tuple[int, int]  # the shared expert's (0, 0 without one)
    vocab: tuple[int, int]  # rows [start, end) of the real vocabulary this rank holds
    vocab_local: int  # rows the rank's embedding has: ceil(vocab / world), zero-padded past ``vocab``

    @property
    def first(self) -> bool:
        """The rank that adds the biases of row-split layers (added once, before the all-reduce)."""
        return self.rank == 0


def head_split(num_heads: int, num_kv_heads: int, world: int) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...]:
    """Per rank ``(q_heads, kv_heads)`` ranges (module docstring); TensorParallelError naming the
    config field when the heads cannot be split by whole groups."""
    if num_heads % num_kv_heads:
        raise TensorParallelError(f"num_attention_heads={num_heads} is not a multiple of "
                                  f"num_key_value_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        return tuple(((k0 * group, k1 * group), (k0, k1)) for k0, k1 in even_ranges(num_kv_heads, world))
    if world % num_kv_heads or num_heads % world:
        raise TensorParallelError(
            f"--tensor-parallel-size {world} cannot split num_key_value_heads={num_kv_heads} (fewer KV heads than "
            f"ranks must divide the ranks) with num_attention_heads={num_heads} (must divide by the ranks)")
    per = num_heads // world
    out = []
    for r in range(world):
        q0 = r * per
        kv = q0 // group
        out.append(((q0, q0 + per), (kv, kv + 1)))
    return tuple(out)


def check_splittable(spec: ModelSpec, world: int) -> None:
    """Refuse, naming the field, a model whose layout this module cannot split ``world`` ways."""
    if world < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be >= 1, got {world}")
    if world == 1:
        return
    if spec.mla is not None:
        raise TensorParallelError(f"{spec.model_type}: multi-head latent attention (kv_lora_rank) is not split for "
                                  "tensor parallelism yet; use --tensor-parallel-size 1")
    if spec.qk_norm_full:
        raise TensorParallelError(f"{spec.model_type}: its q_norm/k_norm span every head (one RMSNorm over the "
                                  "whole projection), which a head split cannot compute locally; use "
                                  "--tensor-parallel-size 1")
    head_split(spec.num_heads, spec.num_kv_heads, world)
    if spec.intermediate_size < world:
        raise TensorParallelError(f"intermediate_size={spec.intermediate_size} is smaller than "
                                  f"--tensor-parallel-size {world}")
    if spec.moe is not None and spec.moe.inter < world:
        raise TensorParallelError(f"moe_intermediate_size={spec.moe.inter} is smaller than "
                                  f"--tensor-parallel-size {world} (experts are split by tensor)")


def rank_layout(spec: ModelSpec, rank: int, world: int) -> RankLayout:
    check_splittable(spec, world)
    q, kv = head_split(spec.num_heads, spec.num_kv_heads, world)[rank]
    moe = spec.moe
    chunk = -(-spec.vocab_size // world)
    v0, v1 = min(rank * chunk, spec.vocab_size), min((rank + 1) * chunk, spec.vocab_size)
    return RankLayout(
        rank=rank, world=world, q_heads=q, kv_heads=kv,
        inter=even_ranges(spec.intermediate_size, world)[rank],
        moe_inter=even_ranges(moe.inter, world)[rank] if moe is not None else (0, 0),
        shared_inter=even_ranges(moe.shared_inter, world)[rank] if moe is not None and moe.shared_inter else (0, 0),
        vocab=(v0, v1), vocab_local=chunk)
