"""CUDA graphs for decode steps: which steps replay a captured graph and how their inputs are
padded (``buckets``, pure), and the capture/replay cache around the model (``graphs``, CUDA only)."""
