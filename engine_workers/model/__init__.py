"""The model, in three rooms that point one way (execution > loading > models > kernels; the
import-linter contracts in pyproject.toml enforce it):

* :mod:`.models`: the decoder and its families (Llama and its relatives, MoE, MLA), the layers its
  forward calls (paged attention, RoPE, experts) and the config spec a checkpoint is parsed into;
* :mod:`.loading`: a checkpoint folder (safetensors, bin, the GGUF blocks) read and mapped onto
  those modules, a tensor-parallel rank's shard cut at load (:mod:`.loading.sharding`);
* :mod:`.execution`: the runner that owns the weights and the KV tensors and executes one scheduled
  batch per step, its CUDA graphs and the tensor-parallel group's processes.
"""
