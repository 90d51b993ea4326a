"""The roofline behind ``lockgate bench engine``'s share figure: the machine's fp32 GEMM FLOP/s,
measured in the same run, and the model FLOPs a run actually executed."""

from __future__ import annotations

import time

import torch


def measure_gemm_flops(dtype=torch.float32, n: int = 1024, seconds: float = 1.5) -> dict[str, float]:
    """fp32 GEMM FLOP/s of this machine, ``n``-cubed, by each path this process can use: plain
    ``torch.mm`` (the BLAS every HF model runs on) and, where available, oneDNN with the weight
    packed once (what lockgate's CPU linears use, engine_workers/kernels/cpu_linear.py). The machine's
    roofline is the faster of the two: on some CPUs (AMD, where the BLAS is not tuned) the two
    differ by more than 2x."""
    from engine_workers.kernels.cpu_linear import PackedLinear, packing_problem

    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)

    def rate(fn) -> float:
        fn()
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            iters += 1
        return 2 * n**3 * iters / (time.perf_counter() - start)

    out = {"torch_mm": rate(lambda: torch.mm(a, b))}
    if packing_problem(torch.device("cpu"), dtype) is None:
        packed = PackedLinear.from_weight(b)
        out["onednn_packed"] = rate(lambda: packed(a))
    return out


def model_flops(spec, computed_tokens: int, sampled_tokens: int, seq_lens: list[int]) -> float:
    """FLOPs of the model work a run did: every linear layer for each computed token, the LM head
    for each sampled token, and attention (QK^T and PV) exactly: a sequence of final length ``L``
    computes positions ``0 .. L-2`` and position ``i`` attends to ``i + 1`` keys. Padding and
    masked-out keys an implementation computes anyway are not counted: they are not useful work."""
    h, hd = spec.hidden_size, spec.head_dim
    per_layer = 2 * h * (spec.num_heads + 2 * spec.num_kv_heads) * hd + 2 * spec.num_heads * hd * h + 2 * 3 * h * spec.intermediate_size
    key_visits = sum((n - 1) * n // 2 for n in seq_lens)
    attn = 4 * spec.num_heads * hd * key_visits * spec.num_layers
    return computed_tokens * spec.num_layers * per_layer + attn + sampled_tokens * 2 * h * spec.vocab_size
