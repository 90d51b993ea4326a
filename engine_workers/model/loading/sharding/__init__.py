"""Tensor-parallel sharding of a model, used by the loader: :mod:`.layout` (which heads, rows and
vocabulary each rank holds: the Megatron layout, attention split by whole GQA groups),
:mod:`.shard` (a rank's slice of the mapped checkpoint and its local spec), :mod:`.layers` (the
all-reduces and the vocabulary-parallel ends). Execution (process group, step broadcast, the
ranks' loops) is :mod:`engine_workers.model.execution.parallel`.
"""
