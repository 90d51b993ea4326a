"""Tensor parallelism on CPU over torch.distributed (gloo): one engine = one TP group, the execution side.

:mod:`.step` (a step's inputs as one broadcast tensor), :mod:`.group` (rank 0's process group,
child ranks and failure handling), :mod:`.follower` (the other ranks' loop), :mod:`.runner`
(rank 0's runner). What each rank holds and how its shard is cut is :mod:`engine_workers.model.loading.sharding`
(below the loader, which cuts a rank's shard at load; this package sits above it).
docs/design-history.md, "Tensor parallelism", has the whole picture.
"""
