"""CLI commands of the engine package: ``generate``, ``model``, ``bench engine`` (and the worker's).

Nothing heavy is imported at module level: torch/transformers load inside the commands.
"""

from __future__ import annotations

import argparse
import sys

from engine_workers.cli import env_default


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (generate, worker, serve, bench)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=env_default("model", "default"), help="HF folder, hub id, or 'default' (SmolLM2-135M-Instruct) [LOCKGATE_MODEL]")
    g.add_argument("--device", default=env_default("device", "auto"), help="auto|cpu|cuda[:N] [LOCKGATE_DEVICE]")
    g.add_argument("--dtype", default=env_default("dtype", "auto"), help="auto (bf16 on CUDA, fp32 on CPU)|float32|bfloat16|float16 [LOCKGATE_DTYPE]")
    g.add_argument("--block-size", type=int, default=env_default("block-size", 16), help="tokens per KV block [LOCKGATE_BLOCK_SIZE]")
    g.add_argument("--kv-cache-bytes", type=_bytes, default=env_default("kv-cache-bytes", None), help="KV budget, e.g. 512M, 4G; default: a fraction of free memory [LOCKGATE_KV_CACHE_BYTES]")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=env_default("kv-cache-memory-fraction", 0.9), help="fraction of free GPU memory for KV [LOCKGATE_KV_CACHE_MEMORY_FRACTION]")
    g.add_argument("--max-num-seqs", type=int, default=env_default("max-num-seqs", 64), help="sequences per step [LOCKGATE_MAX_NUM_SEQS]")
    g.add_argument("--max-num-batched-tokens", type=int, default=env_default("max-num-batched-tokens", 512), help="tokens per step [LOCKGATE_MAX_NUM_BATCHED_TOKENS]")
    g.add_argument("--max-model-len", type=int, default=env_default("max-model-len", None), help="context limit [LOCKGATE_MAX_MODEL_LEN]")
    g.add_argument("--no-prefix-caching", action="store_true", default=env_default("no-prefix-caching", False), help="disable automatic prefix caching [LOCKGATE_NO_PREFIX_CACHING]")
    g.add_argument("--threads", type=int, default=env_default("threads", None), help="torch CPU threads [LOCKGATE_THREADS]")
    g.add_argument("--no-weight-prepack", action="store_true", default=env_default("no-weight-prepack", False),
                   help="CPU float32: keep linears on F.linear instead of oneDNN with weights packed once [LOCKGATE_NO_WEIGHT_PREPACK]")
    g.add_argument("--no-cpu-kernels", action="store_true", default=env_default("no-cpu-kernels", False),
                   help="CPU float32: none of the engine's C++ kernels (paged decode and causal prefill "
                        "attention, fused add + RMSNorm and SiLU gating, the small-batch linear): torch ops and "
                        "oneDNN instead [LOCKGATE_NO_CPU_KERNELS]")


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = str(text).strip().lower().rstrip("ib").rstrip("b") if not str(text).isdigit() else str(text)
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 1048576, 512M, 4G)") from None


def engine_config_from_args(args: argparse.Namespace):
    from engine_workers.config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
        weight_prepack=not args.no_weight_prepack, cpu_kernels=not args.no_cpu_kernels,
    )


def _generate(args: argparse.Namespace) -> int:
    from bus.messages import SamplingParams
    from engine_workers.engine import Engine

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, stop=tuple(args.stop or ()))
    engine = Engine(engine_config_from_args(args))
    chat = not args.raw and getattr(engine.tokenizer, "chat_template", None)
    if chat:
        engine.add_request("cli", params=params, messages=[{"role": "user", "content": args.prompt}])
    else:
        engine.add_request("cli", args.prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished:
                sys.stdout.write("\n")
                print(f"[finish={out.finish_reason} prompt={out.num_prompt_tokens} completion={out.num_output_tokens}]", file=sys.stderr)
    return 0


def _model_fetch(args: argparse.Namespace) -> int:
    from engine_workers.model_store import resolve_model

    print(resolve_model(args.model))
    return 0


def _model_tiny(args: argparse.Namespace) -> int:
    from engine_workers.tiny_model import build_tiny_model

    print(build_tiny_model(args.out, num_layers=args.layers))
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from engine_workers.bench_engine import run

    return run(args)


def register(sub, bench) -> None:
    p = sub.add_parser("generate", help="generate from one prompt, streaming to stdout")
    p.add_argument("prompt")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=_generate)

    m = sub.add_parser("model", help="model checkpoints")
    msub = m.add_subparsers(dest="model_cmd", metavar="ACTION")
    f = msub.add_parser("fetch", help="make the model loadable (converts the default SmolLM2 once) and print its folder")
    f.add_argument("--model", default=env_default("model", "default"))
    f.set_defaults(func=_model_fetch)
    t = msub.add_parser("tiny", help="write a tiny random Llama checkpoint (tests, demos)")
    t.add_argument("out")
    t.add_argument("--layers", type=int, default=2)
    t.set_defaults(func=_model_tiny)

    b = bench.add_parser("engine", help="engine throughput vs HF generate() and HF continuous batching")
    add_engine_args(b)
    b.add_argument("--num-requests", type=int, default=32)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--skip-hf", action="store_true", help="run lockgate only")
    b.add_argument("--repeat", type=int, default=1,
                   help="rounds of every engine and the GEMM peak; each keeps its best (default 1)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=_bench_engine)

    from engine_workers import serve

    serve.register(sub)

    import importlib

    try:
        worker_commands = importlib.import_module("engine_workers.worker_commands")
    except ModuleNotFoundError as exc:
        if exc.name != "engine_workers.worker_commands":
            raise
    else:
        worker_commands.register(sub, bench)
