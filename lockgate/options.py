"""Flags with environment-variable twins, and the engine flags every engine-building command shares
(generate, worker, serve, bench). Nothing heavy at import."""

from __future__ import annotations

import argparse
import os

from engine_workers.engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig  # dataclasses only: cheap
from engine_workers.engine.speculative import SpeculativeConfig  # json + dataclasses only: cheap
from lockgate.lora_options import add_lora_args, lora_config


def env_default(name: str, default: object) -> object:
    """Default for flag ``--name``: env ``LOCKGATE_NAME`` if set, else ``default``."""
    key = "LOCKGATE_" + name.upper().replace("-", "_")
    raw = os.environ.get(key)
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw



def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (generate, worker, serve, bench)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=env_default("model", "default"), help="HF folder, hub id, or 'default' (SmolLM2-135M-Instruct) [LOCKGATE_MODEL]")
    g.add_argument("--device", default=env_default("device", "auto"), help="auto|cpu|cuda[:N] [LOCKGATE_DEVICE]")
    g.add_argument("--dtype", default=env_default("dtype", "auto"),
                   help="auto (bf16 on CUDA; on a CPU the fastest accurate mode measured for its kind: bfloat16 with "
                        "AMX, else float32)|float32|bfloat16|float16; bfloat16 on a CPU: bf16 linear layers (AMX "
                        "tiles with bf16 activations where the CPU has AMX, else bf16 weights and float32 "
                        "activations, needs AVX2 + FMA), float32 everything else [LOCKGATE_DTYPE]")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default=env_default("quantization", "none"),
                   help="int8: weight-only int8 linear weights (per output row scales); q4_1: 4-bit weights in "
                        "ggml Q4_1 blocks of 32 (head Q8_0), read from the GGUF the model was converted from "
                        "(the default model: its exact weights), else quantized at load; both with float32 "
                        "activations. w8a8: int8 weights and int8 activations (per row, dynamic), int32 sums "
                        "(VNNI where the CPU has it): the fastest CPU mode. CPU with AVX2 + FMA or AVX-512 "
                        "(LOCKGATE_CPU_ISA: the kernels' ISA level) [LOCKGATE_QUANTIZATION]")
    g.add_argument("--block-size", type=int, default=env_default("block-size", 16), help="tokens per KV block [LOCKGATE_BLOCK_SIZE]")
    g.add_argument("--kv-cache-bytes", type=_bytes, default=env_default("kv-cache-bytes", None), help="KV budget, e.g. 512M, 4G; default: a fraction of free memory [LOCKGATE_KV_CACHE_BYTES]")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   default=env_default("kv-cache-dtype", "auto"),
                   help="K/V cache storage: auto (the compute dtype)|float32|bfloat16|float16 (CUDA); bfloat16 on a "
                        "CPU halves KV memory and decode's KV reads, attention math stays float32 [LOCKGATE_KV_CACHE_DTYPE]")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=env_default("kv-cache-memory-fraction", 0.9), help="fraction of free GPU memory for KV [LOCKGATE_KV_CACHE_MEMORY_FRACTION]")
    g.add_argument("--max-num-seqs", type=int, default=env_default("max-num-seqs", 64), help="sequences per step [LOCKGATE_MAX_NUM_SEQS]")
    g.add_argument("--max-num-batched-tokens", type=int, default=env_default("max-num-batched-tokens", 2048), help="tokens per step: decodes + prefill chunks [LOCKGATE_MAX_NUM_BATCHED_TOKENS]")
    g.add_argument("--max-model-len", type=int, default=env_default("max-model-len", None), help="context limit [LOCKGATE_MAX_MODEL_LEN]")
    g.add_argument("--no-prefix-caching", action="store_true", default=env_default("no-prefix-caching", False), help="disable automatic prefix caching [LOCKGATE_NO_PREFIX_CACHING]")
    g.add_argument("--threads", type=int, default=env_default("threads", None), help="torch CPU threads [LOCKGATE_THREADS]")
    g.add_argument("--no-weight-prepack", action="store_true", default=env_default("no-weight-prepack", False),
                   help="CPU float32: keep linears on F.linear instead of oneDNN with weights packed once [LOCKGATE_NO_WEIGHT_PREPACK]")
    g.add_argument("--no-cpu-kernels", action="store_true", default=env_default("no-cpu-kernels", False),
                   help="CPU float32: none of the engine's C++ kernels (paged decode and causal prefill "
                        "attention, fused add + RMSNorm and SiLU gating, the small-batch linear): torch ops and "
                        "oneDNN instead [LOCKGATE_NO_CPU_KERNELS]")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=env_default("tensor-parallel-size", 1),
                   help="ranks of one tensor-parallel group (CPU, gloo over 127.0.0.1): this process is rank 0 and "
                        "starts the others itself, one torch thread each; attention split by whole GQA groups, "
                        "MLP and MoE experts by tensor, vocabulary in equal slices; 1 = off [LOCKGATE_TENSOR_PARALLEL_SIZE]")
    g.add_argument("--enforce-eager", action="store_true", default=env_default("enforce-eager", False),
                   help="CUDA: run every step eager, no decode CUDA graphs (captured at start by default, one per "
                        "batch x table-width bucket); no effect on a CPU [LOCKGATE_ENFORCE_EAGER]")
    g.add_argument("--speculative-config", type=speculative_arg, default=env_default("speculative-config", None),
                   help="speculative decoding as a JSON object with vLLM's keys, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'; "
                        "methods ngram (prompt lookup) and draft_model (with \"model\": a smaller checkpoint with "
                        "the same tokenizer); optional disable_by_batch_size (default 8): "
                        "no speculation while more sequences run. Tokens are those of plain decoding, greedy "
                        "and seeded. Default: off [LOCKGATE_SPECULATIVE_CONFIG]")
    g.add_argument("--priority-preemption-margin", type=_margin, default=env_default("priority-preemption-margin", "1.0"),
                   help="a waiting request at least this much more urgent in tier than the worst running one "
                        "preempts it when every slot is busy or the KV cache has no room for it (1.0 = one tier, "
                        "the default); 'none' = never [LOCKGATE_PRIORITY_PREEMPTION_MARGIN]")
    g.add_argument("--tpot-budget", action=argparse.BooleanOptionalAction, default=env_default("tpot-budget", True),
                   help="size each step so the running decodes keep their tier's TPOT target (measured step time); "
                        "--no-tpot-budget: the fixed --max-num-batched-tokens, as vLLM (default on) "
                        "[LOCKGATE_TPOT_BUDGET]")
    add_lora_args(p, env_default)


def _margin(text: str) -> float | None:
    if str(text).strip().lower() in ("none", "off", ""):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a margin: {text!r} (a number > 0, or none)") from None


def speculative_arg(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = str(text).strip().lower().rstrip("ib").rstrip("b") if not str(text).isdigit() else str(text)
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 1048576, 512M, 4G)") from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        quantization=getattr(args, "quantization", "none"), block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
        weight_prepack=not args.no_weight_prepack, cpu_kernels=not args.no_cpu_kernels,
        priority_preemption_margin=_margin(getattr(args, "priority_preemption_margin", "1.0")),
        tpot_budget=getattr(args, "tpot_budget", True),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        enforce_eager=getattr(args, "enforce_eager", False),
        speculative_config=getattr(args, "speculative_config", None),
        **lora_config(args),
    )
