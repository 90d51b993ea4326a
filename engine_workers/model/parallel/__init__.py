"""Tensor parallelism on CPU over torch.distributed (gloo): one engine = one TP group.

One concept per module: :mod:`.layout` (which heads, rows and vocabulary each rank holds: the
Megatron layout, attention split by whole GQA groups), :mod:`.shard` (a rank's slice of the mapped
checkpoint and its local spec), :mod:`.layers` (the all-reduces and the vocabulary-parallel ends),
:mod:`.step` (a step's inputs as one broadcast tensor), :mod:`.group` (rank 0's process group,
child ranks and failure handling), :mod:`.follower` (the other ranks' loop), :mod:`.runner`
(rank 0's runner). docs/design.md, "Tensor parallelism", has the whole picture.
"""
