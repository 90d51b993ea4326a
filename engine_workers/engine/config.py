"""Engine configuration. Every field has a CLI flag and a ``LOCKGATE_*`` env var (README)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_workers.engine.speculative import SpeculativeConfig  # json + dataclasses only: cheap

QUANTIZATIONS = ("none", "int8", "q4_1", "w8a8")  # --quantization (kernels/cpu_linear.py plans them)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # --kv-cache-dtype (model/execution/runner.py resolves them)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # None/"default" = SmolLM2-135M-Instruct (converted on first use)
    device: str = "auto"  # auto = cuda if available, else cpu
    dtype: str = "auto"  # auto = bf16 on CUDA; on CPU bf16 linears with AMX, else fp32 (cpu_linear.auto_cpu_dtype); bfloat16 on CPU = bf16 linears, fp32 rest
    # none | int8 (CPU: weight-only int8, per output row) | q4_1 (CPU: Q4_1 blocks of 32, head Q8_0,
    # from the GGUF the model came from where it did); both with float32 activations | w8a8 (CPU:
    # int8 weights and int8 activations per row, int32 sums on VNNI)
    quantization: str = "none"
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int | None = None  # KV budget; None = a fraction of free device memory
    # K/V storage: auto (= the compute dtype; bf16 on a CPU with bf16 linears on AMX tiles,
    # cpu_linear.auto_kv_cache_dtype) | float32 | bfloat16 | float16 (CUDA). Storage only:
    # bfloat16 on a CPU halves KV bytes (twice the blocks per budget); attention math stays fp32
    # except the prefill kernel's float16 pass on CPUs with AVX512-FP16 (docs/design.md).
    kv_cache_dtype: str = "auto"
    kv_cache_memory_fraction: float = 0.9  # of free GPU memory (CPU: of a quarter of free RAM, <= 1 GiB)
    max_num_seqs: int = 64  # sequences per step
    # tokens per step (prefill chunks + decodes); vLLM's API-server default. Larger lets a long
    # prompt prefill in one step (docs/design.md, Scheduling)
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # context limit; None = the model's, capped by KV capacity
    long_prefill_token_threshold: int = 0  # max prompt tokens of one sequence per step (0 = budget)
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    weight_prepack: bool = True  # CPU fp32: linears on oneDNN with weights packed once (cpu_linear.py)
    cpu_kernels: bool = True  # CPU fp32: decode attention on the engine's own kernel (cpu_kernels.py)
    seed: int = 0  # engine RNG for unseeded sampling
    # Preempt the worst running sequence for a waiting one at least this much more urgent in tier
    # (1.0 = one tier, the default: tiers are protected out of the box); None = never
    # (scheduler.py, "Priority preemption": slots full or the KV cache full, bounded per sequence,
    # recompute vs a one-step wait by cost; docs/worker.md, "SLOs")
    priority_preemption_margin: float | None = 1.0
    # Size each step so it lasts at most the strictest TPOT target of the running decodes
    # (Sequence.tpot_slo_s, set by the worker from its tier's SLO; step_model.py); False: the fixed
    # max_num_batched_tokens budget, as vLLM's chunked prefill
    tpot_budget: bool = True
    # ranks of one tensor-parallel group (CPU, gloo; engine_workers/model/execution/parallel): rank 0 is this
    # process, the others are child processes it starts; 1 = no group, nothing distributed
    tensor_parallel_size: int = 1
    # CUDA: no decode CUDA graphs, every step eager (vLLM's name). Without it decode steps replay
    # graphs captured at start (engine_workers/model/execution/cudagraph); no effect on a CPU
    enforce_eager: bool = False
    # Speculative decoding (vLLM's --speculative-config, engine.speculative): None = off. With it,
    # a decoding request's proposed tokens are verified in the same forward as its decode token;
    # the tokens produced are those plain decoding produces (docs/design-history.md, Speculative decoding)
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (vLLM's flags; engine_workers/model/lora, docs/lora.md). ``lora_modules``:
    # (name, folder) of each PEFT adapter a request may name; ``max_loras``: distinct adapters in
    # one batch (the model's slots); ``max_lora_rank``: the largest rank accepted;
    # ``max_cpu_loras``: loaded adapters kept in host memory (None = max_loras)
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.priority_preemption_margin is not None and not self.priority_preemption_margin > 0:
            raise ValueError(f"priority_preemption_margin must be > 0 or None, got {self.priority_preemption_margin}")
        if self.quantization not in QUANTIZATIONS:
            names = ", ".join(QUANTIZATIONS[:-1]) + " or " + QUANTIZATIONS[-1]
            raise ValueError(f"quantization must be {names}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a SpeculativeConfig, got {type(self.speculative_config).__name__}")
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config with tensor_parallel_size > 1 is not implemented yet "
                             "(the ranks' step codec carries no verification rows)")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_cpu_loras is not None and not (isinstance(self.max_cpu_loras, int)
                                                   and self.max_cpu_loras >= self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")
        if self.enable_lora and self.quantization == "w8a8":
            raise ValueError("enable_lora with quantization w8a8 is not implemented (its fused int8 MLP has no place "
                             "for an adapter's update); use int8 (weight-only) or none (docs/lora.md)")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not implemented (adapters are not "
                             "sharded yet; docs/lora.md)")
        lora_names = [n for n, _ in self.lora_modules]
        dup = next((n for n in lora_names if lora_names.count(n) > 1), None)
        if dup is not None or any(not n for n in lora_names):
            raise ValueError(f"lora_modules names must be unique and non-empty, got {lora_names!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
