"""Linear layers on ggml block-quantized weights on CPU (``--quantization q4_1``): the kernel
bindings of ``csrc/block_linear.cpp``, its check, and :class:`BlockLinear`.

Layers keep their weights as Q4_1 blocks and the (tied) head as Q8_0 blocks
(:mod:`engine_workers.kernels.block_quant`), regrouped once at load into the kernel's panels
(:func:`pack_blocks`: same codes and scales, 64 output columns per panel). Every row count runs
on the kernel, which reads each block once per call: up to 4 rows it dequantizes in registers and
uses the weights at once; from 5 rows (larger decode batches, prefill chunks) it dequantizes 128 k
at a time into an L1 buffer that every row tile reuses, i.e. a float32 micro-GEMM on a
dequantized tile. Measured on SmolLM2's shapes, that matched or beat both float32 oneDNN and
dequantizing the whole weight for torch's GEMM at every row count up to 1024
(benchmarks/micro/block_linear.py, docs/benchmarks.md "4-bit weights"), so there is no separate
prefill path; the whole-weight dequantization (:meth:`BlockLinear.dequantized`) serves the load-time
check. Results equal F.linear of the dequantized weight up to float32 summation order. Design:
docs/design-history.md ("Precision and devices").

The kernel is part of the engine's extension module (:mod:`engine_workers.kernels.cpu_kernels`
builds it) and is checked against ``F.linear`` on random blocks before use; where it cannot build
or disagrees, :func:`block_problem` says why and the engine keeps float32 weights
(:func:`engine_workers.kernels.cpu_linear.cpu_weight_plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_workers.kernels import cpu_kernels as kernels
from engine_workers.kernels.block_quant import QK, BlockWeight, quantize

PANEL = 64  # output columns per panel of csrc/block_linear.cpp (its NC)
KIND_CODES = {"q4_1": 0, "q8_0": 1}
REGISTER_ROWS = 4  # up to this many rows the kernel dequantizes in registers (csrc/block_linear.cpp, MR)


@dataclass(frozen=True, slots=True)
class BlockOps:
    """The block-weight kernels (``csrc/block_linear.cpp``); x and y float32."""

    linear: Callable  # (x [M, K] contiguous f32, packed, kind code, N, bias or None) -> [M, N]
    dequant_t: Callable  # (packed, kind code, N, K) -> W^T [K, N] float32


def block_ops() -> BlockOps | None:
    """The block-weight kernels, or ``None`` (then :func:`block_problem` says why). Thread-safe."""
    return kernels._resolved("blocks", _resolve, "Q4_1/Q8_0 block-weight kernels unavailable")


def block_problem() -> str | None:
    block_ops()
    return kernels._state["blocks_problem"]


def pack_blocks(w: BlockWeight) -> torch.Tensor:
    """Regroup ``w``'s codes and scales into the kernel's records, uint8 ``[P, K / 32, S]``: per
    panel of 64 output columns and k block, the 64 columns' float16 ``d`` (then, Q4_1, ``m``),
    then the codes, one row of 64 columns per byte index within the block (columns past N zero).
    Values are copied, never changed."""
    n, k = w.shape
    p, kb = -(-n // PANEL), k // QK

    def panels(t: torch.Tensor, per_block: int) -> torch.Tensor:  # [N, KB * per_block] -> [P, KB, per_block * 64] bytes
        t = t.contiguous().view(torch.uint8).view(n, kb, -1)
        padded = torch.zeros(p * PANEL, kb, t.shape[2], dtype=torch.uint8)
        padded[:n] = t
        # [P, 64, KB, B] -> [P, KB, B / per, 64, per]: byte index outer, column inner
        return padded.view(p, PANEL, kb, -1, per_block).permute(0, 2, 3, 1, 4).reshape(p, kb, -1)

    parts = [panels(w.scales, 2)]
    if w.mins is not None:
        parts.append(panels(w.mins, 2))
    parts.append(panels(w.codes, 1))
    return torch.cat(parts, dim=2).contiguous()


class BlockLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` kept only as Q4_1 or Q8_0 blocks (:class:`BlockWeight`) in the
    kernel's panels; ``x`` and ``y`` float32, any leading shape. Inference only."""

    def __init__(self, kind: str, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                 out_features: int, ops: BlockOps) -> None:
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.packed, self.bias = packed, bias  # plain attributes: not parameters
        self._code = KIND_CODES[kind]
        self._ops = ops

    @classmethod
    def from_blocks(cls, w: BlockWeight, bias: torch.Tensor | None = None, ops: BlockOps | None = None) -> BlockLinear:
        ops = ops if ops is not None else block_ops()
        if ops is None:
            raise RuntimeError(f"block-weight kernels unavailable: {block_problem()}")
        n, k = w.shape
        b = None if bias is None else bias.detach().float().contiguous()
        if b is not None and b.shape != (n,):
            raise ValueError(f"bias must have shape ({n},); got {tuple(b.shape)}")
        return cls(w.kind, pack_blocks(w), b, k, n, ops)

    @classmethod
    def quantized(cls, kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  ops: BlockOps | None = None) -> BlockLinear:
        """From a float weight, quantized at load (:func:`engine_workers.kernels.block_quant.quantize`)."""
        return cls.from_blocks(quantize(kind, weight), bias, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1] if x.dim() else 0} features, the layer {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = self._ops.linear(x2.contiguous(), self.packed, self._code, self.out_features, self.bias)
        return y.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` (a transposed view) this layer computes with."""
        return self._ops.dequant_t(self.packed, self._code, self.out_features, self.in_features).t()

    def weight_bytes(self) -> int:
        return self.packed.numel()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weights={self.kind} blocks")


def _check(ops: BlockOps) -> str | None:
    """Compare both loops of both formats, and the dequantization, with ``F.linear`` of the
    dequantized weight over row-tile, panel and 128-k group tails, with and without bias; ``None``
    when they agree."""
    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 64, 32), (3, 100, 96), (13, 200, 320)):
        w, b, x = (torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen))
        for kind in ("q4_1", "q8_0"):
            blocks = quantize(kind, w)
            packed, wd = pack_blocks(blocks), blocks.dequantize()
            if not torch.equal(ops.dequant_t(packed, KIND_CODES[kind], n, k), wd.t()):
                return f"{kind} block dequantization disagrees with torch at N={n} K={k}"
            for bias in (None, b):
                got, want = ops.linear(x, packed, KIND_CODES[kind], n, bias), F.linear(x, wd, bias)
                if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                    return f"{kind} block linear kernel disagrees with F.linear at M={m} N={n} K={k}"
    return None


def _resolve() -> tuple[BlockOps | None, str | None]:
    return kernels._checked(lambda m: BlockOps(m.block_linear, m.block_dequant_t), _check, "block-weight kernels")
