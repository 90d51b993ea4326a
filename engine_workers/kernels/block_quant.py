"""ggml's block-quantized weight formats, Q4_1 and Q8_0, as torch tensors (``--quantization q4_1``).

A weight ``[N, K]`` (``K`` a multiple of 32) is cut along ``K`` into blocks of 32; each block of
each output row keeps its own float16 scale ``d`` (and, in Q4_1, float16 offset ``m``):

* Q4_1: 4-bit codes ``q`` in 0..15, ``w = d * q + m``; in the GGUF a block is ``d, m`` then 16
  bytes, element ``j`` in the low nibble of byte ``j`` and element ``j + 16`` in its high nibble.
  5 bits per weight.
* Q8_0: int8 codes, ``w = d * q``. 8.5 bits per weight.

:class:`BlockWeight` keeps exactly those codes and scales (the GGUF's nibble order included), so
blocks read from a GGUF file (:mod:`engine_workers.model.loading.gguf_blocks`) are used unchanged, and
:func:`quantize` makes the same blocks from a float weight the way ggml's reference quantizers do.
The dequantized weight is exact in float32 (``d * q`` has at most 11 + 8 significant bits, so
``d * q + m`` rounds once, as an FMA does): this is how the default model's float32 folder was made
from its GGUF, and what the kernels (:mod:`engine_workers.kernels.cpu_blocks`) compute with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  # weights per block (ggml's QK4_1 and QK8_0)
KINDS = ("q4_1", "q8_0")
BLOCK_BYTES = {"q4_1": 4 + QK // 2, "q8_0": 2 + QK}  # bytes per block in a GGUF file


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """A weight ``[N, K]`` in ggml block format (see the module docstring). ``codes``: Q4_1 uint8
    ``[N, K / 2]`` (GGUF nibble order within each 16-byte block), Q8_0 int8 ``[N, K]``;
    ``scales`` (``d``) and, Q4_1 only, ``mins`` (``m``): float16 ``[N, K / 32]``."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"block format must be one of {', '.join(KINDS)}; got {self.kind!r}")
        n, nb = self.scales.shape if self.scales.dim() == 2 else (-1, -1)
        code_dtype, per_block = (torch.uint8, QK // 2) if self.kind == "q4_1" else (torch.int8, QK)
        if self.scales.dtype != torch.float16 or n < 0:
            raise ValueError(f"{self.kind} scales must be float16 [N, K/32]; got {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}")
        if self.codes.dtype != code_dtype or tuple(self.codes.shape) != (n, nb * per_block):
            raise ValueError(f"{self.kind} codes must be {code_dtype} [{n}, {nb * per_block}]; got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")
        if (self.kind == "q4_1") != (self.mins is not None):
            raise ValueError("q4_1 blocks need mins (m); q8_0 blocks have none")
        if self.mins is not None and (self.mins.dtype != torch.float16 or self.mins.shape != self.scales.shape):
            raise ValueError(f"q4_1 mins must be float16 {tuple(self.scales.shape)}; got {self.mins.dtype} "
                             f"{tuple(self.mins.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * QK

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` the blocks stand for (exact, see the module docstring)."""
        n, k = self.shape
        d = self.scales.float().unsqueeze(-1)
        if self.kind == "q8_0":
            return (self.codes.view(n, -1, QK).float() * d).view(n, k)
        raw = self.codes.view(n, -1, QK // 2)
        q = torch.cat([raw & 0xF, raw >> 4], dim=-1).float()  # elements j and j + 16 of each block
        assert self.mins is not None
        return torch.addcmul(self.mins.float().unsqueeze(-1), q, d).view(n, k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Row-wise concatenation (as the loader fuses q/k/v and gate/up): blocks run along K, so a
        row selection keeps them whole."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"cannot concatenate blocks of kinds {sorted(kinds)} and widths "
                             f"{sorted({p.shape[1] for p in parts})}")
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
        return BlockWeight(parts[0].kind, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins)

    @staticmethod
    def from_gguf_bytes(kind: str, raw: torch.Tensor) -> BlockWeight:
        """Blocks from a GGUF tensor's data: uint8 ``[N, K / 32 * block bytes]`` (one row per output)."""
        if kind not in KINDS:
            raise ValueError(f"block format must be one of {', '.join(KINDS)}; got {kind!r}")
        size = BLOCK_BYTES[kind]
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
            raise ValueError(f"{kind} data must be uint8 [N, K/32 * {size}]; got {raw.dtype} {tuple(raw.shape)}")
        n, raw = raw.shape[0], raw.contiguous()
        # Records are 20 / 34 bytes: as int16 lanes, d (and m) are lanes 0 (and 1) and the codes the
        # rest, so each field is one strided copy of 2- or 4-byte elements (byte-wise copies are slow).
        lanes = raw.view(torch.int16).view(n, -1, size // 2)
        d = lanes[..., 0].contiguous().view(torch.float16)
        if kind == "q8_0":
            return BlockWeight(kind, lanes[..., 1:].contiguous().view(torch.int8).view(n, -1), d)
        m = lanes[..., 1].contiguous().view(torch.float16)
        codes = raw.view(torch.int32).view(n, -1, size // 4)[..., 1:].contiguous().view(torch.uint8).view(n, -1)
        return BlockWeight(kind, codes, d, m)


def quantize(kind: str, w: torch.Tensor) -> BlockWeight:
    """Quantize a float weight ``[N, K]`` the way ggml's reference quantizers do (per block of 32):

    * Q4_1: ``d = (max - min) / 15``, ``m = min``, ``q = min(15, trunc((w - min) / d + 0.5))``;
    * Q8_0: ``d = max|w| / 127``, ``q = round(w / d)`` (half away from zero);

    codes computed from the float32 ``d`` and ``m``, which are then stored as float16. Raises
    ``ValueError`` for a shape the format cannot hold or weights that are not finite."""
    if kind not in KINDS:
        raise ValueError(f"block format must be one of {', '.join(KINDS)}; got {kind!r}")
    if w.dim() != 2 or w.shape[1] % QK or not w.is_floating_point():
        raise ValueError(f"{kind} needs a floating-point weight [N, K] with K a multiple of {QK}; got "
                         f"{w.dtype} {tuple(w.shape)}")
    n = w.shape[0]
    x = w.detach().float().reshape(n, -1, QK)
    if not torch.isfinite(x).all():
        raise ValueError(f"cannot quantize a weight with non-finite values to {kind}")
    if kind == "q8_0":
        d = x.abs().amax(-1) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d)).unsqueeze(-1)
        v = x * inv
        q = (v.sign() * torch.floor(v.abs() + 0.5)).to(torch.int8)
        return BlockWeight(kind, q.view(n, -1), _half(d, kind))
    lo, hi = x.amin(-1), x.amax(-1)
    d = (hi - lo) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d)).unsqueeze(-1)
    q = ((x - lo.unsqueeze(-1)) * inv + 0.5).trunc().clamp_(0, 15).to(torch.uint8)
    codes = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    return BlockWeight(kind, codes.reshape(n, -1).contiguous(), _half(d, kind), _half(lo, kind))


def _half(t: torch.Tensor, kind: str) -> torch.Tensor:
    h = t.to(torch.float16)
    if not torch.isfinite(h).all():
        raise ValueError(f"weights too large for {kind}'s float16 scales (|value| over 65504)")
    return h.contiguous()
