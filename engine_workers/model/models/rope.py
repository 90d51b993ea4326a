"""Rotary position embeddings: the rotation tables every ``rope_type`` transformers defines for the
supported families (default, linear, dynamic, yarn, llama3, longrope), in the interleaved layout the
attention uses, and the per-token lookup.

Most types are one fixed table: entry ``[p, j]`` is ``scaling * exp(i * p * inv_freq[j])``. Two are
not, in transformers, and lockgate reproduces them per sequence rather than per batch:

* ``longrope`` (Phi-3): a sequence whose context exceeds ``original_max_position_embeddings``
  rotates its new tokens with the long factors, others with the short ones. Two tables; each token
  looks up the one its sequence's context at this step selects.
* ``dynamic`` (NTK): once a context exceeds ``max_position_embeddings`` the base grows with it and the
  new tokens of that step rotate with frequencies for that length. Within the original length the
  fixed table; beyond it, the step's frequencies are computed for the sequence's context.

In both, keys already in the cache keep the rotation they were written with, as transformers'
cache keeps them; docs/design-history.md, "RoPE scaling", says what that means for long contexts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

IMPLEMENTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def _params(cfg, layer_type: str | None) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        return params[layer_type]
    return params


def inv_freq(cfg, head_dim: int, layer_type: str | None = None, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim / 2]`` and the attention scaling of ``cfg``'s RoPE (the
    ``layer_type`` entry of per-layer-type parameters, Gemma 3), from transformers' own init
    functions for the scaled types; ValueError naming the field for anything else."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _params(cfg, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type not in IMPLEMENTED_ROPE_TYPES:
        raise ValueError(f"config field rope_parameters.rope_type={rope_type!r} is not implemented "
                         f"(implemented: {', '.join(IMPLEMENTED_ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config field rope_parameters.partial_rotary_factor={params['partial_rotary_factor']} is "
                         "not implemented (full rotary only)")
    kwargs = {"layer_type": layer_type} if layer_type is not None and layer_type in (cfg.rope_parameters or {}) else {}
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    else:
        freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), seq_len=seq_len, **kwargs)
    if freq.numel() * 2 != head_dim:
        raise ValueError(f"rope gives {freq.numel()} frequencies for head_dim {head_dim}: partial rotary is not implemented")
    return freq.float(), float(scaling)


def table(freq: torch.Tensor, scaling: float, length: int) -> torch.Tensor:
    """``[length, D/2]`` complex64 rotations. Float32 whatever the model dtype: complex bf16 does not
    exist, and rotating in float32 loses nothing."""
    angles = torch.outer(torch.arange(length, dtype=torch.float32), freq)
    return torch.polar(torch.full_like(angles, scaling), angles)


class Rope:
    """One layer type's rotations; :meth:`rotations` gives ``[T, 1, D/2]`` for a step's tokens."""

    def __init__(self, base: torch.Tensor, switch: int | None = None, long: torch.Tensor | None = None,
                 dynamic: Callable[[int], tuple[torch.Tensor, float]] | None = None) -> None:
        self.base = base  # [L, D/2] complex: the table within the original context
        self.switch = switch  # contexts longer than this take ``long`` or ``dynamic`` (None: never)
        self.long = long  # longrope: the long factors' table
        self.dynamic = dynamic  # dynamic NTK: context length -> (inv_freq, scaling)

    @property
    def needs_ends(self) -> bool:
        """Whether :meth:`rotations` needs each token's sequence context (``AttnMetadata.seq_ends``)."""
        return self.switch is not None

    def rotations(self, positions: torch.Tensor, ends: torch.Tensor | None) -> torch.Tensor:
        rot = self.base[positions]
        if self.switch is None or ends is None:
            return rot.unsqueeze(1)
        beyond = ends > self.switch
        if bool(beyond.any()):
            if self.long is not None:
                rot = torch.where(beyond[:, None], self.long[positions], rot)
            elif self.dynamic is not None:
                rot = rot.clone()
                for end in ends[beyond].unique().tolist():
                    rows = (ends == end).nonzero().squeeze(1)
                    freq, scaling = self.dynamic(int(end))
                    angles = positions[rows].float()[:, None].cpu() * freq[None, :]
                    rot[rows] = torch.polar(torch.full_like(angles, scaling), angles).to(rot.device)
        return rot.unsqueeze(1)


def build_rope(cfg, head_dim: int, length: int, device: torch.device, layer_type: str | None = None) -> Rope:
    """The :class:`Rope` of ``cfg`` for contexts up to ``length``."""
    params = _params(cfg, layer_type)
    rope_type = params.get("rope_type", "default")
    freq, scaling = inv_freq(cfg, head_dim, layer_type)
    base = table(freq, scaling, length).to(device)
    if rope_type == "longrope":
        original = int(params.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        long_freq, long_scaling = inv_freq(cfg, head_dim, layer_type, seq_len=original + 1)
        return Rope(base, original, long=table(long_freq, long_scaling, length).to(device))
    if rope_type == "dynamic":
        original = int(cfg.max_position_embeddings)
        return Rope(base, original, dynamic=lambda n: inv_freq(cfg, head_dim, layer_type, seq_len=n))
    return Rope(base)


def interleave_rope_rows(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Reorder a q or k projection's output rows (weight ``[heads * head_dim, ...]`` or bias) from
    HF's half-split RoPE layout (dim ``j`` rotates with ``j + head_dim / 2``) to interleaved pairs
    (``2j`` with ``2j + 1``), so a head is ``head_dim / 2`` complex numbers and RoPE is one complex
    multiply (see :func:`apply_rope`). Attention only takes dot products of q with k, which a
    permutation applied to both leaves unchanged; V and the output are not touched."""
    half = head_dim // 2
    rest = w.shape[1:]
    return w.reshape(heads, 2, half, *rest).transpose(1, 2).reshape(heads * head_dim, *rest)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]`` in the interleaved layout (any row stride), ``rot`` ``[T, 1, D/2]``
    complex: one complex multiply instead of HF's four multiplies, a negation and a concatenation
    over strided views (docs/design-history.md, "RoPE as one complex multiply", has the figures)."""
    t, h, d = x.shape
    if x.dtype == torch.float32:
        return torch.view_as_real(torch.view_as_complex(x.view(t, h, d // 2, 2)) * rot).view(t, h, d)
    xc = torch.view_as_complex(x.float().reshape(t, h, d // 2, 2))
    return torch.view_as_real(xc * rot).view(t, h, d).to(x.dtype)
