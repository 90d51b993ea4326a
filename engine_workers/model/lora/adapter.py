"""A PEFT LoRA adapter mapped onto lockgate's layers.

PEFT stores, per adapted module of the HF model, ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``;
the module's output gains ``scale * x @ A^T @ B^T``. lockgate fuses q/k/v into ``qkv_proj`` and
gate/up into ``gate_up_proj`` (models/llama.py), so an adapter's pieces are fused the same way:
the A matrices of the pieces it adapts are stacked (``[r_q + r_k + ..., in]``: every piece reads
the same input) and B is block-diagonal over the fused output rows, each piece's block in its own
rows and zero elsewhere. An adapter on q only thus fills only the q rows of the fused output.
q and k rows are reordered to the interleaved RoPE layout exactly as the base weights are
(:func:`~engine_workers.model.models.rope.interleave_rope_rows`), and ``scale`` is folded into B
once, here. One ``(A, B)`` pair per lockgate layer: the batched update is one GEMM pair per
adapter and layer (:mod:`.layers`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_workers.model.lora.peft_config import LoraError, PeftLoraConfig, read_config
from engine_workers.model.models.rope import interleave_rope_rows
from engine_workers.model.models.spec import ModelSpec

_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")

# HF module -> (our layer under the decoder layer, index of the piece in the fused output)
_TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
            "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
            "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
            "down_proj": ("mlp.down_proj", 0)}
TARGET_MODULES = tuple(_TARGETS)


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One lockgate layer's update: ``x @ a.T @ b.T`` (``a`` ``[R, in]``, ``b`` ``[out, R]``, scale in ``b``)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """``layers``: our module names (``layers.3.self_attn.qkv_proj``) -> their update. ``rank``:
    the largest rank of any adapted HF module."""

    name: str
    path: Path
    rank: int
    layers: dict[str, LoraWeights]

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.layers.values())


def _pieces(spec: ModelSpec, layer: str) -> tuple[list[tuple[int, int, int | None]], int]:
    """The fused output's pieces ``(first row, rows, heads to interleave or None)`` of our ``layer``
    (its name under a decoder layer), and its input width."""
    d, hq, hkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    q, kv, inter = hq * d, hkv * d, spec.intermediate_size
    if layer == "self_attn.qkv_proj":
        return [(0, q, hq), (q, kv, hkv), (q + kv, kv, None)], spec.hidden_size
    if layer == "self_attn.o_proj":
        return [(0, spec.hidden_size, None)], q
    if layer == "mlp.gate_up_proj":
        return [(0, inter, None), (inter, inter, None)], spec.hidden_size
    return [(0, spec.hidden_size, None)], inter  # mlp.down_proj


def _check_model(spec: ModelSpec, name: str, layer_index: int, module: str) -> None:
    if layer_index >= spec.num_layers:
        raise LoraError(f"LoRA adapter {name!r}: {module} is past the model's {spec.num_layers} layers")
    if spec.mla is not None and ".self_attn." in module:
        raise LoraError(f"LoRA adapter {name!r}: {module}: LoRA on multi-head latent attention is not implemented")
    if spec.moe is not None and spec.moe.sparse_layers[layer_index] and ".mlp." in module:
        raise LoraError(f"LoRA adapter {name!r}: {module}: LoRA on a sparse MoE layer's experts is not implemented")


def load_adapter(name: str, path: str | Path, spec: ModelSpec, dtype: torch.dtype = torch.float32,
                 max_rank: int | None = None) -> LoraAdapter:
    """Read the adapter at ``path`` (``adapter_config.json`` + ``adapter_model.safetensors``) for
    the base model ``spec`` (the whole model's; tensor parallelism is refused by the engine);
    weights end up in ``dtype`` (the engine's compute dtype) on the CPU. Every problem is a
    :class:`LoraError` naming the adapter and what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter {name!r}: {folder} is not a folder")
    config = read_config(folder, name)
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        extra = " (adapter_model.bin is not read: save with safe_serialization)" if (folder / "adapter_model.bin").exists() else ""
        raise LoraError(f"LoRA adapter {name!r}: {file} does not exist{extra}")
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(file))
    except Exception as exc:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {file}: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(4) not in _TARGETS:
            module = m.group(1) if m else key
            raise LoraError(f"LoRA adapter {name!r}: tensor {key}: lockgate adapts only "
                            f"{', '.join(TARGET_MODULES)} of the decoder layers, not {module}")
        _check_model(spec, name, int(m.group(2)), m.group(1))
        pairs.setdefault(m.group(1), {})[m.group(5)] = tensor
    if not pairs:
        raise LoraError(f"LoRA adapter {name!r}: {file} holds no LoRA weights")
    return LoraAdapter(name, folder, *_fuse(name, pairs, config, spec, dtype, max_rank))


def _fuse(name: str, pairs: dict[str, dict[str, torch.Tensor]], config: PeftLoraConfig, spec: ModelSpec,
          dtype: torch.dtype, max_rank: int | None) -> tuple[int, dict[str, LoraWeights]]:
    grouped: dict[str, dict[int, tuple[str, torch.Tensor, torch.Tensor]]] = {}
    top = 0
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"LoRA adapter {name!r}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                            "do not make a rank-r pair")
        rank = a.shape[0]
        if max_rank is not None and rank > max_rank:
            raise LoraError(f"LoRA adapter {name!r}: {module} has rank {rank}, above --max-lora-rank {max_rank}")
        top = max(top, rank)
        layer_index, hf = module.split(".")[2], module.rsplit(".", 1)[1]
        ours, piece = _TARGETS[hf]
        grouped.setdefault(f"layers.{layer_index}.{ours}", {})[piece] = (module, a, b * config.scale(module, rank))
    layers = {}
    for ours, pieces in grouped.items():
        layout, width = _pieces(spec, ours.split(".", 2)[2])
        rows = layout[-1][0] + layout[-1][1]
        total = sum(a.shape[0] for _, a, _ in pieces.values())
        a_all = torch.zeros((total, width), dtype=torch.float32)
        b_all = torch.zeros((rows, total), dtype=torch.float32)
        col = 0
        for piece, (module, a, b) in sorted(pieces.items()):
            first, n, heads = layout[piece]
            if a.shape[1] != width or b.shape[0] != n:
                raise LoraError(f"LoRA adapter {name!r}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                                f"do not fit the base layer ({n} outputs, {width} inputs): an adapter of another model?")
            r = a.shape[0]
            a_all[col:col + r] = a.float()
            b_all[first:first + n, col:col + r] = interleave_rope_rows(b.float(), heads, spec.head_dim) if heads else b.float()
            col += r
        layers[ours] = LoraWeights(a_all.to(dtype).contiguous(), b_all.to(dtype).contiguous())
    return top, layers
