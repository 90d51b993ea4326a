"""The HF baselines of ``lockgate bench engine``: HF ``generate()`` in padded static batches of 8,
and transformers' own continuous batching (``ContinuousBatchingManager``). Each runs in a process of
its own (benchmarks/engine/procs.py), on the engine's device, with lockgate's torch thread count.

Precision (:func:`hf_precision`): HF loads the model in the dtype lockgate was asked for, where
plain transformers has that mode. ``--dtype bfloat16`` makes HF's whole model bf16 (weights,
activations, KV cache: transformers runs a model in the dtype it is loaded in; on a CPU its matmuls
are torch's bf16 GEMMs), whereas lockgate's bf16 on a CPU is bf16 linear weights with float32
activations. ``--quantization`` (int8, ...): plain transformers has no weight-only quantization
without an extra package (bitsandbytes, torchao, optimum-quanto), so the HF rows run float32 and say so.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from benchmarks.engine.workload import Workload
    from engine_workers.engine.config import EngineConfig


def hf_precision(config: EngineConfig, device_type: str) -> tuple[str, str]:
    """(dtype HF loads the model in, what that means next to lockgate's mode), for ``config``."""
    auto = "bfloat16" if device_type == "cuda" else "float32"
    requested = auto if config.dtype == "auto" else config.dtype
    if config.quantization != "none":
        return auto, (f"{auto} (HF lacks {config.quantization} weights: plain transformers needs an extra "
                      "quantization package for it)")
    if requested in ("bfloat16", "float16") and device_type == "cpu":
        return requested, (f"{requested} throughout (weights, activations, KV cache: torch's CPU {requested} "
                           "GEMMs); lockgate's is low-precision linear weights, float32 activations")
    return requested, requested


def load_model(path: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()  # type: ignore[arg-type]  # PreTrainedModel.to is functools.wraps'd; typeshed's _Wrapped does not bind self
    model.generation_config.eos_token_id = None  # EOS ignored: every engine makes exactly the tokens asked for
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFStatic:
    """HF ``generate()`` in padded static batches (left padding; a batch runs until its longest
    request is done)."""

    def __init__(self, model, batch: int = 8) -> None:
        self.model, self.batch = model, batch

    def run(self, wl: Workload) -> float:
        from transformers import GenerationConfig

        pad, device = 0, self.model.device
        _sync(device)
        start = time.perf_counter()
        for i in range(0, len(wl.prompts), self.batch):
            prompts, outs = wl.prompts[i : i + self.batch], wl.outputs[i : i + self.batch]
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            cfg = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=None, pad_token_id=pad)
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=mask, generation_config=cfg)
            if out.shape[1] != width + max(outs):
                raise RuntimeError(f"HF generate() made {out.shape[1] - width} tokens, not {max(outs)}")
        _sync(device)
        return time.perf_counter() - start

    def close(self) -> None:
        pass


class HFContinuous:
    """transformers' continuous batching with one manager for the process's life, as lockgate's
    engine lives across rounds: its set-up (cache allocation, its own warm-up) is not timed, as
    lockgate's engine construction is not. Block sharing (HF's prefix cache) is off: every round
    sends the same prompts, and lockgate's runs use a fresh prefix-cache salt each."""

    def __init__(self, model, max_new_tokens: int, kv_tokens: int | None) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        # The KV cache: as many tokens as lockgate's budget. Left to itself on a CPU, transformers
        # takes 90 % of the host's free RAM for it (and a shared machine's OOM killer the process).
        page = ContinuousBatchingConfig().page_size
        blocks = -(-kv_tokens // page) if kv_tokens else None
        cb = ContinuousBatchingConfig(allow_block_sharing=False, num_blocks=blocks)
        self.kv_tokens = blocks * page if blocks else None
        self._stack = contextlib.ExitStack()
        self.manager = self._stack.enter_context(model.continuous_batching_context_manager(
            generation_config=cfg, block=True, timeout=5, continuous_batching_config=cb))
        self._runs = 0

    def run(self, wl: Workload) -> float:
        """Seconds from the first request added to the last result."""
        self._runs += 1
        start = time.perf_counter()
        ids = {self.manager.add_request(p, request_id=f"r{self._runs}-{i}", max_new_tokens=m): m
               for i, (p, m) in enumerate(zip(wl.prompts, wl.outputs))}
        pending = set(ids)
        deadline = time.monotonic() + 3600
        while pending and time.monotonic() < deadline:
            res = self.manager.get_result(timeout=1)
            if res is not None and res.is_finished() and res.request_id in pending:
                if res.error:
                    raise RuntimeError(f"HF continuous batching failed {res.request_id}: {res.error}")
                if len(res.generated_tokens) != ids[res.request_id]:
                    raise RuntimeError(f"HF continuous batching made {len(res.generated_tokens)} tokens for "
                                       f"{res.request_id}, not {ids[res.request_id]}")
                pending.discard(res.request_id)
        elapsed = time.perf_counter() - start
        if pending:
            raise RuntimeError(f"HF continuous batching left {len(pending)} requests unfinished")
        return elapsed

    def close(self) -> None:
        self._stack.close()
