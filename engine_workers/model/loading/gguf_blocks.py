"""The quantized blocks of a GGUF checkpoint, under the names of lockgate's fused linear layers.

Why: the default model ships as a Q4_1 GGUF, and its float32 folder is those blocks dequantized
(tokenization/model_store.py). ``--quantization q4_1`` therefore loads the blocks themselves
(:class:`engine_workers.kernels.block_quant.BlockWeight`) instead of re-quantizing the float32
weights, which would round them a second time: the engine then computes with exactly the float32
model's weights (tests/engine_workers/kernels/test_block_weights.py proves it bit for bit on SmolLM2).

Row mapping (GGUF tensor -> lockgate parameter; blocks run along K, so any row order keeps them):

* ``blk.{i}.attn_q/attn_k/attn_v`` -> ``layers.{i}.self_attn.qkv_proj`` rows ``[q; k; v]``: rows
  unchanged. llama.cpp's converter permutes q/k rows from HF's half-split RoPE layout to pairs
  ``(2j, 2j + 1)`` per head, the very permutation lockgate applies to HF weights
  (:func:`engine_workers.model.models.llama.interleave_rope_rows`), so GGUF order is lockgate's order;
* ``attn_output`` -> ``o_proj``; ``ffn_gate``, ``ffn_up`` -> ``gate_up_proj`` rows ``[gate; up]``;
  ``ffn_down`` -> ``down_proj``;
* ``token_embd`` (tied embeddings) or ``output`` -> ``lm_head``, where that tensor is in a block
  format (else the caller quantizes the head at load).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from engine_workers.kernels.block_quant import KINDS, BlockWeight
from engine_workers.model.models.llama import ModelSpec
from tokenization.model_store import ModelError

log = logging.getLogger(__name__)

CONVERTED_MARKER = "lockgate-converted.json"  # written by tokenization/model_store.py's conversion


def gguf_source(folder: Path | str) -> Path | None:
    """The GGUF file a model folder was converted from (its marker's ``source``), or ``None`` when
    the folder has no marker or the file is gone."""
    marker = Path(folder) / CONVERTED_MARKER
    try:
        source = json.loads(marker.read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    path = Path(source) if isinstance(source, str) else None
    return path if path is not None and path.is_file() else None


def read_blocks(gguf: Path) -> dict[str, BlockWeight]:
    """Every Q4_1 / Q8_0 tensor of ``gguf`` by its GGUF name (other types are skipped). Raises
    :class:`ModelError` for a file that cannot be read."""
    import gguf as gguf_lib

    try:
        reader = gguf_lib.GGUFReader(str(gguf))
    except Exception as exc:  # a truncated or foreign file raises many different types
        raise ModelError(f"cannot read GGUF file {gguf}: {type(exc).__name__}: {exc}") from None
    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name.lower()
        if kind in KINDS:
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
            try:
                out[t.name] = BlockWeight.from_gguf_bytes(kind, raw)
            except ValueError as exc:
                raise ModelError(f"GGUF file {gguf}: tensor {t.name}: {exc}") from None
    return out


def layer_blocks(gguf: Path, spec: ModelSpec) -> dict[str, BlockWeight]:
    """The blocks of ``gguf`` under lockgate's parameter names (``layers.{i}.self_attn.qkv_proj``,
    ..., ``lm_head``, without ``.weight``), fused as the loader fuses float weights (module
    docstring); ``lm_head`` only where the head's tensor is in a block format. Raises
    :class:`ModelError` naming the first layer tensor that is missing or not in a block format;
    the caller checks shapes against the model."""
    blocks = read_blocks(gguf)

    def take(name: str) -> BlockWeight:
        try:
            return blocks[name]
        except KeyError:
            raise ModelError(f"GGUF file {gguf} has no Q4_1/Q8_0 tensor {name}") from None

    def cat(names: list[str]) -> BlockWeight:
        try:
            return BlockWeight.cat([take(n) for n in names])
        except ValueError as exc:
            raise ModelError(f"GGUF file {gguf}: cannot fuse {', '.join(names)}: {exc}") from None

    out = {}
    for i in range(spec.num_layers):
        src, dst = f"blk.{i}.", f"layers.{i}."
        out[dst + "self_attn.qkv_proj"] = cat([src + f"attn_{x}.weight" for x in "qkv"])
        out[dst + "self_attn.o_proj"] = take(src + "attn_output.weight")
        out[dst + "mlp.gate_up_proj"] = cat([src + "ffn_gate.weight", src + "ffn_up.weight"])
        out[dst + "mlp.down_proj"] = take(src + "ffn_down.weight")
    head = blocks.get("token_embd.weight" if spec.tie_word_embeddings else "output.weight")
    if head is not None:
        out["lm_head"] = head
    return out
