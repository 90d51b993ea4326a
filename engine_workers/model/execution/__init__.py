"""Running a loaded model one scheduled batch per step: :mod:`.runner` (the weights, the KV tensors,
one forward over the mixed prefill+decode batch), :mod:`.cudagraph` (decode steps replayed as
captured CUDA graphs) and :mod:`.parallel` (a tensor-parallel group's processes, step broadcast and
rank 0's runner). The top room of the model: it imports loading and models, neither imports it.
"""
