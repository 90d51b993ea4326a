"""The model runner: owns the weights and the KV tensors, executes one scheduled batch per step.

It decides nothing: the scheduler picked the tokens, the KV manager picked the blocks, the engine
put both into a :class:`~engine_workers.model.execution.batch.ModelInput`. One forward runs the whole mixed
prefill+decode batch (no per-sequence loop over the model) and returns a ``RunnerOutput``.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine_workers.model.execution.batch import ModelInput, RunnerOutput
from engine_workers.model.loading.loader import LoadedModel
from engine_workers.model.lora.manager import LoraManager
from engine_workers.model.models.attention import MAX_DECODE_GROUPS, build_metadata
from engine_workers.model.models.llama import ModelSpec

log = logging.getLogger(__name__)

_SDPA_NO_CUDNN = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V, or MLA's latent and RoPE key), ``dtype`` the
    cache's storage dtype."""
    return spec.kv_elems_per_token * block_size * dtype_size(dtype)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPUs without AMX have no fast bf16 GEMM (docs/design.md, "Precision and devices"): fp32 is the CPU default.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {name!r}")
    return table[name]


def resolve_kv_dtype(name: str, compute: torch.dtype, device: torch.device) -> torch.dtype:
    """The K/V cache's storage dtype for ``--kv-cache-dtype name``; ``auto`` = ``compute``, the
    engine's compute dtype. Storage only: the write converts, the readers widen to ``compute``
    (model/attention.py). On a CPU (float32 compute) ``bfloat16`` halves the bytes every decode
    step reads per context token; ``float16`` is refused there (the same size as bf16 but with a
    narrow exponent range, and the CPU kernels do not read it). On CUDA every choice works through
    SDPA, which attends over a gathered copy converted to the compute dtype."""
    if name == "auto":
        return compute
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(table)}; got {name!r}")
    kv = table[name]
    if kv == torch.float16 and device.type == "cpu" and compute != torch.float16:
        raise ValueError("--kv-cache-dtype float16 is for CUDA; on a CPU use bfloat16 (the same size, float32's "
                         "exponent range, and read by the engine's CPU attention kernels)")
    return kv


def gpu_memory_utilization(device: torch.device) -> float | None:
    """The fraction of ``device``'s memory in use by anyone (the driver's free/total, so other
    processes count too), None off CUDA. One driver call, no sync with the device's queue."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / total if total else None


def kv_budget_blocks(
    spec: ModelSpec, block_size: int, dtype: torch.dtype, device: torch.device,
    kv_cache_bytes: int | None, memory_fraction: float,
) -> int:
    """Blocks that fit the KV budget, ``dtype`` the cache's storage dtype: a bf16 cache fits twice
    the blocks of a float32 one in the same bytes."""
    per_block = kv_block_bytes(spec, block_size, dtype)
    if kv_cache_bytes is None:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            kv_cache_bytes = int(free * memory_fraction)
        else:
            import psutil

            kv_cache_bytes = int(min(psutil.virtual_memory().available * memory_fraction * 0.25, 1 << 30))
    blocks = kv_cache_bytes // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_bytes={kv_cache_bytes} is smaller than one KV block ({per_block} bytes)")
    return int(blocks)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 cpu_kernels: bool = True, kv_dtype: torch.dtype | None = None,
                 cuda_graphs: tuple[int, int] | None = None) -> None:
        """``dtype``: the compute dtype; ``kv_dtype``: the K/V cache's storage dtype (None = ``dtype``).
        ``cuda_graphs``: ``(max_num_seqs, max_model_len)`` to capture decode CUDA graphs for
        (:mod:`engine_workers.model.execution.cudagraph`); on CUDA only, ignored elsewhere."""
        self.model = loaded.model
        # the modules' own spec: under tensor parallelism the rank's heads only (its cache's shape)
        self.spec = loaded.model.spec
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype = kv_dtype or dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        graphs_wanted = cuda_graphs is not None and device.type == "cuda"
        # with CUDA graphs, one more block past the KV manager's pool: the padded rows' dummy block
        slots = (num_blocks + int(graphs_wanted)) * block_size
        # per layer two tensors [slots, *shape]: K and V, or MLA's latent and RoPE key (model/mla.py);
        # the block pool is the same either way, a block being block_size slots of every layer
        k_shape, v_shape = self.spec.kv_slot_shapes
        self.kv_caches = [
            (torch.zeros((slots, *k_shape), dtype=kv_dtype, device=device),
             torch.zeros((slots, *v_shape), dtype=kv_dtype, device=device))
            for _ in range(self.spec.num_layers)
        ]
        # CPU float32: attention on the engine's own kernels where they build (cpu_kernels.py); they
        # read a float32 or a bf16 cache (cpu_kernels.KV_DTYPES)
        self.decode_kernel = self.prefill_kernel = None
        # Decode groups trade launches for padding. A CPU is compute-bound: padded keys cost FLOPs,
        # so sequences are grouped by length. A GPU step of a small model is launch-bound (the host
        # issues ~20 kernels per layer and the device waits): one padded group per step, as every
        # extra group costs more launches than its padding saves (figures from an H200 in
        # docs/design.md, Paged attention, and docs/gpu.md).
        self.max_decode_groups = MAX_DECODE_GROUPS if device.type == "cpu" else 1
        # cuDNN's SDPA plans each new shape the first time it sees it (a batch size, a padded width,
        # a prefill length) and a serving batch keeps making new shapes, so the planning never stops
        # costing (same figures). The flash and memory-efficient kernels need no plan.
        self.sdpa_backends = _SDPA_NO_CUDNN if device.type == "cuda" else None
        if cpu_kernels and device.type == "cpu" and dtype == torch.float32:
            from engine_workers.kernels import cpu_kernels as kernels

            if kv_dtype in kernels.KV_DTYPES and self.spec.mla is None:  # the kernels read per-head K/V
                self.decode_kernel = kernels.paged_decode()
                self.prefill_kernel = kernels.prefill_attention()
            self.model.use_fused(kernels.fused())
        self.graphs = None
        # LoRA adapters (engine --enable-lora): set by the engine after construction; it captures
        # no CUDA graphs then (the segments change every step)
        self.lora: LoraManager | None = None
        if graphs_wanted:
            assert cuda_graphs is not None
            self.graphs = _decode_graphs(self, *cuda_graphs)
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %s, %.1f MiB", num_blocks, block_size, num_blocks * block_size,
                 str(kv_dtype).removeprefix("torch."), kv_block_bytes(self.spec, block_size, kv_dtype) * num_blocks / 2**20)

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> RunnerOutput:
        """Run ``batch``'s one forward (:class:`~engine_workers.model.execution.batch.ModelInput` says which
        rows come back and what with them)."""
        if self.graphs is not None and not (batch.verify or batch.replay or batch.prefill or batch.states):
            out = self.graphs.run(batch.chunks, batch.every_row, batch.hidden, bool(batch.sum_chunks))
            if out is not None:
                return RunnerOutput(out)
        ids: list[int] = []
        meta_in = []
        logit_rows: list[int] = []
        firsts = []
        verify = set(batch.verify)
        for i, (tokens, start, blocks, samples) in enumerate(batch.chunks):
            firsts.append(len(ids))
            ids.extend(tokens)
            meta_in.append((start, len(tokens), blocks))
            if i in verify:
                logit_rows.extend(range(firsts[-1], len(ids)))
            elif samples:
                logit_rows.append(len(ids) - 1)
        meta, positions = build_metadata(meta_in, self.block_size, self.device, self.dtype,
                                         self.decode_kernel, self.prefill_kernel, self.max_decode_groups,
                                         seq_ends=self.model.needs_seq_ends, decode_rows=batch.decode_rows,
                                         prefill_chunks=frozenset(batch.prefill))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        rows = (torch.arange(len(ids), device=self.device) if batch.every_row
                else torch.tensor(logit_rows, dtype=torch.long, device=self.device))
        # the model's forward appends its extra results to these lists (given only when wanted)
        hidden: list[torch.Tensor] | None = [] if batch.hidden else None
        sums: list[torch.Tensor] | None = [] if batch.sum_chunks else None
        spans = [(firsts[i], len(batch.chunks[i].token_ids)) for i in batch.sum_chunks] if sums is not None else None
        states: list[torch.Tensor] | None = [] if batch.states else None
        if self.lora is not None:
            self.lora.prepare(batch.loras or [None] * len(batch.chunks), [len(c.token_ids) for c in batch.chunks])
        try:
            with sdpa_kernel(list(self.sdpa_backends)) if self.sdpa_backends else contextlib.nullcontext():
                logits = self.model(input_ids, positions, self.kv_caches, meta, rows, hidden, spans, sums,
                                    *((states,) if states is not None else ()))
        finally:
            if self.lora is not None:
                self.lora.done()
        return RunnerOutput(logits, hidden[0] if hidden else None, sums[0] if sums else None,
                            states[0] if states else None)

def _decode_graphs(runner: ModelRunner, max_num_seqs: int, max_model_len: int):
    """The runner's captured decode graphs, or None (logged) where its model cannot be captured
    or capture fails (then every step runs eager, as with ``--enforce-eager``)."""
    from engine_workers.model.execution.cudagraph.graphs import DecodeGraphs, graph_problem

    problem = graph_problem(runner.model)
    if problem is not None:
        log.info("CUDA graphs off (every step eager): %s", problem)
        return None
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.num_blocks, runner.dtype,
                          runner.device, max_num_seqs, max_model_len, runner.sdpa_backends)
    try:
        graphs.capture_all()
    except Exception as exc:  # out of memory, a kernel that cannot be captured: serve eager instead
        log.warning("CUDA graphs off (every step eager): capture failed: %s: %s", type(exc).__name__, exc)
        return None
    return graphs
