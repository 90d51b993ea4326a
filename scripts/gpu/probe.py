"""CUDA probe: where an engine step's time goes, and bf16 numerics against HF.

``probe.py speed MODEL VARIANT [PROFILE_OUT]``: the bench engine workload (128 requests) run three
times in one process on a fresh engine; prints each run's seconds, steps and tokens/s. VARIANT is
``+``-joined from: ``base``, ``onegroup`` (one decode group), ``nocudnn`` (no cuDNN SDPA).
With PROFILE_OUT the third run is under cProfile (top functions printed to that file).

``probe.py numerics MODEL``: next-token logits of a prompt, through a prefill and through a decode
step (prompt[:-1] prefilled, its last token decoded), for lockgate bf16 and fp32 and HF bf16, each
against HF fp32: relative L2 error and whether the argmax agrees.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
import uuid

import torch

from benchmarks.engine.bench import make_workload, sync_device
from bus import SamplingParams
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.core import Engine
from engine_workers.model.execution.batch import Chunk, ModelInput

DEV = os.environ.get("PROBE_DEVICE", "cuda")  # cpu: a dry run of the script itself


def _sync() -> None:
    sync_device(torch.device(DEV))


def speed(model: str, variant: str, profile_out: str | None) -> None:
    opts = set(variant.split("+"))
    if "nocudnn" in opts:
        torch.backends.cuda.enable_cudnn_sdp(False)
    engine = Engine(EngineConfig(model=model, device=DEV, kv_cache_bytes=(8 << 30) if DEV == "cuda" else (256 << 20)))
    if "onegroup" in opts:
        engine.runner.max_decode_groups = 1
    wl = make_workload(engine.loaded.spec.vocab_size, int(os.environ.get("PROBE_REQUESTS", 128)), 0)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in wl.outputs]
    for i in range(3):
        steps0, prof = engine.stats.steps, None
        if profile_out and i == 2:
            prof = cProfile.Profile()
            prof.enable()
        _sync()
        t0 = time.perf_counter()
        engine.generate(wl.prompts, params, cache_salt=uuid.uuid4().hex)
        _sync()
        dt = time.perf_counter() - t0
        if prof:
            prof.disable()
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("tottime").print_stats(30)
            st.sort_stats("cumulative").print_stats(40)
            open(profile_out, "w").write(s.getvalue())
        steps = engine.stats.steps - steps0
        print(f"{variant:24} run {i}: {dt:6.2f} s  {wl.output_tokens / dt:7.0f} tok/s  steps {steps}"
              f"  {dt / max(steps, 1) * 1e3:.1f} ms/step", flush=True)


def _logits(engine: Engine, prompt: list[int], decode: bool) -> torch.Tensor:
    bs = engine.kv.block_size
    blocks = list(range(-(-len(prompt) // bs)))
    if not decode:
        return engine.runner.execute(ModelInput((Chunk(prompt, 0, blocks, True),))).logits[0]
    engine.runner.execute(ModelInput((Chunk(prompt[:-1], 0, blocks, False),)))
    return engine.runner.execute(ModelInput((Chunk(prompt[-1:], len(prompt) - 1, blocks, True),))).logits[0]


def numerics(model: str) -> None:
    from transformers import AutoModelForCausalLM

    vocab = Engine(EngineConfig(model=model, device="cpu", kv_cache_bytes=16 << 20)).loaded.spec.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 117, 300)]
    ref_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(DEV).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(DEV).eval()
    engines = {dt: Engine(EngineConfig(model=model, device=DEV, dtype=dt, kv_cache_bytes=64 << 20))
               for dt in ("float32", "bfloat16")}
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=DEV)
            ref = ref_model(ids).logits[0, -1].float()
            row = [f"len {len(p):4d}"]
            cands = {"hf-bf16": hf16(ids).logits[0, -1].float()}
            for dt, eng in engines.items():
                cands[f"lg-{dt[:4]}-prefill"] = _logits(eng, p, False)
                cands[f"lg-{dt[:4]}-decode"] = _logits(eng, p, True)
            for name, x in cands.items():
                err = ((x - ref).norm() / ref.norm()).item()
                row.append(f"{name} {err:.2e}{'' if x.argmax() == ref.argmax() else ' (argmax differs)'}")
            print("  ".join(row), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "speed":
        from engine_workers.engine import torch_thread

        # On the engine's torch thread, as `lockgate` runs it: the steps then run in this call
        # (not handed to that thread), so cProfile sees them.
        torch_thread.call(speed, sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
    else:
        numerics(sys.argv[2])
