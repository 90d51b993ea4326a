"""Rank 0's runner of a tensor-parallel group: the engine's ``ModelRunner`` interface over the group.

Each ``execute`` broadcasts the step's inputs (:mod:`engine_workers.model.execution.parallel.step`) and then
runs rank 0's own shard, whose collectives pair with the other ranks'; the logits come back whole
on rank 0 (the head's gather). A failure of the group raises
:class:`~engine_workers.model.loading.sharding.layout.TensorParallelError` here, never a hang.
"""

from __future__ import annotations

import torch

from engine_workers.model.execution.batch import ModelInput, RunnerOutput
from engine_workers.model.execution.parallel import step as step_codec
from engine_workers.model.execution.parallel.group import TpGroup
from engine_workers.model.execution.runner import ModelRunner
from engine_workers.model.loading.loader import LoadedModel, load_model
from engine_workers.model.loading.sharding.layout import TensorParallelError


def load_group(group: TpGroup, load: dict) -> LoadedModel:
    """Every rank loads its shard of ``load`` (:func:`load_model`'s keyword arguments), the others
    while rank 0 loads its own; returns rank 0's."""
    group.send(("load", load))
    return load_model(**load, tp_rank=(0, group.world))


class ParallelRunner:
    """Holds rank 0's :class:`ModelRunner` (``local``: its heads, its cache) and the group."""

    def __init__(self, group: TpGroup, loaded: LoadedModel, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, cpu_kernels: bool = True, kv_dtype: torch.dtype | None = None) -> None:
        self.group = group
        args = dict(num_blocks=num_blocks, block_size=block_size, device=device, dtype=dtype,
                    cpu_kernels=cpu_kernels, kv_dtype=kv_dtype)
        group.send(("runner", args))
        self.local = ModelRunner(loaded, **args)  # type: ignore[arg-type]
        group.wait_ready("building the KV cache")
        self.model, self.spec, self.kv_caches = self.local.model, self.local.spec, self.local.kv_caches
        self.block_size, self.num_blocks = block_size, num_blocks

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> RunnerOutput:
        # pooling (hidden, sum_chunks) reads rank 0's replicated final-norm states after the forward
        # and needs no collective, so the followers run the step without it
        self.group.broadcast_step(step_codec.encode(batch.chunks, batch.every_row, step_codec.modes_of(batch)))
        try:
            return self.local.execute(batch)
        except TensorParallelError:
            raise
        except RuntimeError as exc:
            if "gloo" in str(exc).lower() or "connection" in str(exc).lower() or self.group.broken is not None:
                raise self.group.collective_failed(exc) from None
            self.group.check()  # a rank died: say so rather than the symptom
            raise

    def close(self) -> None:
        self.group.close()
