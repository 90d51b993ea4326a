"""MLA decode over the paged latent cache: absorbed (what engine_workers/model/models/mla.py runs) vs expanded
(the per-head K/V rebuilt from the cached latents at every step), one layer (docs/benchmarks-moe.md).

    .venv/bin/python -m benchmarks.micro.mla [--heads 16] [--threads 2] [--contexts 256,1024,4096] [--batches 1,8]

Dimensions default to DeepSeek-V2-Lite's attention (16 heads, kv_lora_rank 512, rope 64, nope 128,
v 128), float32, block size 16. Prints per batch and context the best-of-n milliseconds of each form,
their ratio, and the largest difference between their outputs (the same function, rounded apart).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable


def _best_ms(f: Callable[[], object], n: int) -> float:
    f()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--nope", type=int, default=128)
    ap.add_argument("--v", type=int, default=128)
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    import torch

    from engine_workers.model.models.llama import RMSNorm
    from engine_workers.model.models.mla import MlaAttention, MlaSpec

    torch.set_num_threads(args.threads)
    h, rank, rope, nope, v = args.heads, args.kv_lora_rank, args.rope, args.nope, args.v
    spec = MlaSpec(h, None, rank, nope, rope, v, (nope + rope) ** -0.5)
    layer = MlaAttention(spec, 2048, lambda d: RMSNorm(d, 1e-6)).requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    layer.kv_b.copy_(torch.randn(layer.kv_b.shape, generator=gen) * rank**-0.5)
    bs = 16
    print(f"MLA decode, one layer: {h} heads, latent {rank} + rope {rope}, nope {nope}, v {v}, float32, "
          f"{args.threads} threads; best of {args.repeats}")
    print(f"{'batch':>5} {'context':>7} {'absorbed ms':>11} {'expanded ms':>11} {'ratio':>6} {'max diff':>9}")
    for b in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            ta, te, diff = _measure(layer, spec, (h, rank, nope, rope, v), b, ctx, bs, gen, args.repeats)
            print(f"{b:>5} {ctx:>7} {ta:>11.2f} {te:>11.2f} {te / ta:>6.1f} {diff:>9.1e}")


def _measure(layer, spec, dims: tuple[int, int, int, int, int], b: int, ctx: int, bs: int, gen,
             repeats: int) -> tuple[float, float, float]:
    """One (batch, context) point: best-of times of the absorbed and expanded decode, and their max difference."""
    import torch
    import torch.nn.functional as F

    from engine_workers.kernels.paged_reference import gather_blocks
    from engine_workers.model.models.attention import build_metadata

    h, rank, nope, rope, v = dims
    per = -(-(ctx + 1) // bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    c_cache = torch.randn(b * per * bs, 1, rank, generator=gen)
    pe_cache = torch.randn(b * per * bs, 1, rope, generator=gen)
    meta, _ = build_metadata([(ctx, 1, t) for t in tables], bs, torch.device("cpu"), max_decode_groups=1)
    q_nope = torch.randn(b, h, nope, generator=gen)
    q_pe = torch.randn(b, h, rope, generator=gen)
    out_a = torch.empty(b, h, v)

    def absorbed() -> None:
        layer._decode(q_nope, q_pe, c_cache, pe_cache, meta, out_a)

    def expanded() -> torch.Tensor:
        g = meta.decode[0]
        c = gather_blocks(c_cache, g.blocks, bs)[:, :, 0]  # [B, N, R]
        pe = gather_blocks(pe_cache, g.blocks, bs)[:, :, 0]
        n = c.shape[1]
        kv = F.linear(c, layer.kv_b).view(b, n, h, nope + v)
        k = torch.cat([kv[..., :nope], pe[:, :, None, :].expand(b, n, h, rope)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)[:, :, None, :]  # [B, H, 1, nope + rope]
        assert g.mask is not None
        return F.scaled_dot_product_attention(q, k.transpose(1, 2), kv[..., nope:].transpose(1, 2),
                                              attn_mask=g.mask, scale=spec.scale)[:, :, 0]

    with torch.inference_mode():
        ta = _best_ms(absorbed, repeats)
        te = _best_ms(expanded, repeats)
        diff = (out_a - expanded()).abs().max().item()
    return ta, te, diff



if __name__ == "__main__":
    main()
