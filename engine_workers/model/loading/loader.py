"""Load an HF checkpoint folder (config, tokenizer, safetensors/bin weights) into ``LlamaForPagedLM``.

Every failure is a :class:`ModelError` naming the path and the problem: missing folder, missing
config, unsupported architecture, missing/mis-shaped/corrupt weights.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from engine_workers.model.loading.checkpoint import CheckpointReader, DictSource, ReadHook, WeightSource
from engine_workers.model.models.llama import (
    MLP,
    DecoderLayer,
    LlamaForPagedLM,
    ModelSpec,
    interleave_rope_rows,
)
from engine_workers.model.models.mla import map_mla_state
from engine_workers.model.models.moe import GroupedExperts
from engine_workers.model.models.moe_family import map_moe_state
from engine_workers.model.models.split import Split
from tokenization.model_store import ModelError, resolve_model

if TYPE_CHECKING:
    from engine_workers.model.loading.sharding.layout import RankLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    path: Path | str
    model: LlamaForPagedLM
    spec: ModelSpec
    tokenizer: object
    hf_config: object
    eos_token_ids: tuple[int, ...]


def checkpoint_state(path: Path, spec: ModelSpec, layout: RankLayout | None = None,
                     on_read: ReadHook | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under our names (:func:`_map_state`) for the full model ``spec``;
    with a rank ``layout``, that rank's shard, read slice by slice so no whole sharded tensor is
    ever in memory (:mod:`engine_workers.model.loading.checkpoint`); ``on_read`` hears every read."""
    local = spec
    if layout is not None:
        from engine_workers.model.loading.sharding.shard import local_spec

        local = local_spec(spec, layout)
    with CheckpointReader(path, spec, layout, on_read) as reader:
        # the pieces are mapped with the rank's own spec: its heads, rows and expert slices
        state = _map_state(reader, local, path)
    if layout is not None:
        from engine_workers.model.loading.sharding.shard import finish_local

        state = finish_local(state, layout)
    return state


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:
        raise ModelError(f"model {repo_id!r} is neither a local folder nor downloadable: {exc}") from None


def load_model(spec: str | Path | None, dtype: torch.dtype, device: torch.device, max_len: int | None = None,
               weight_prepack: bool = True, cpu_kernels: bool = True, lowp: str | None = None,
               tp_rank: tuple[int, int] | None = None) -> LoadedModel:
    """Load ``spec`` (a folder, ``default`` or a hub id). ``weight_prepack``: on CPU in float32,
    run the linear layers on oneDNN with weights packed once (:mod:`engine_workers.kernels.cpu_linear`);
    with ``cpu_kernels`` too, decode-sized batches on the engine's own kernel where it builds.
    ``lowp``: ``"bfloat16"``, ``"int8"`` or ``"q4_1"`` (from
    :func:`engine_workers.kernels.cpu_linear.cpu_weight_plan`, CPU, ``dtype`` float32): the linear
    layers keep only that copy of their weights, on the engine's low-precision kernel; everything
    else stays ``dtype``. ``q4_1``: Q4_1 layers and a Q8_0 head, read from the GGUF the folder was
    converted from where there is one (:func:`_blocks`), else quantized at load.
    ``tp_rank``: ``(rank, world)`` of a tensor-parallel group of two or more: the model is that
    rank's shard (:mod:`engine_workers.model.execution.parallel`), the returned ``spec`` the local one (its
    heads, rows and vocabulary slice), and its forward communicates with the other ranks."""
    from transformers import AutoConfig, AutoTokenizer

    resolved = resolve_model(spec)
    path = resolved if isinstance(resolved, Path) else _hub_snapshot(resolved)
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise ModelError(f"cannot read config of {path}: {exc}") from None
    try:
        mspec = ModelSpec.from_hf(hf_config)
    except ValueError as exc:
        raise ModelError(f"model {path}: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelError(f"cannot load tokenizer of {path}: {exc}") from None

    layout = None
    if tp_rank is not None and tp_rank[1] > 1:
        from engine_workers.model.loading.sharding.layout import TensorParallelError, rank_layout

        try:
            layout = rank_layout(mspec, *tp_rank)
        except TensorParallelError as exc:
            raise ModelError(f"model {path}: {exc}") from None
    state = checkpoint_state(path, mspec, layout)
    full_spec = mspec
    if layout is not None:
        from engine_workers.model.loading.sharding.shard import local_spec

        mspec = local_spec(mspec, layout)
    with torch.device("meta"):
        model = LlamaForPagedLM(mspec)
    model = _materialize(model, state, mspec, dtype, device, f"the checkpoint {path}")
    if lowp == "q4_1":
        _blocks(model, Path(path))
    elif lowp is not None:
        _lowp(model, lowp)
    elif weight_prepack:
        _prepack(model, device, dtype, cpu_kernels)
    if layout is not None:
        from engine_workers.model.loading.sharding.layers import parallelize

        parallelize(model, layout, full_spec.vocab_size)
    length = max_len or mspec.max_position_embeddings
    rope_type = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type")
    if rope_type in ("longrope", "dynamic"):
        log.warning("%s RoPE: a sequence is rotated by its context at each step; one whose chunks or decode cross "
                    "the original context keeps its earlier keys' rotation (transformers re-rotates them; "
                    "docs/design-history.md, RoPE scaling)", rope_type)
    try:
        model.set_ropes(hf_config, max(length, 1), device)
    except ValueError as exc:
        raise ModelError(f"model {path}: {exc}") from None
    # the whole model's spec; under tensor parallelism ``model.spec`` is the rank's local one
    return LoadedModel(path, model, full_spec, tokenizer, hf_config, _eos_ids(path, hf_config, tokenizer))


class _MtpNames:
    """The checkpoint's MTP module ``model.layers.{L}.*`` seen as a one-layer model's names (layer
    0, ``model.norm``, ``lm_head``, ``model.embed_tokens``), so :func:`_map_state` maps it."""

    def __init__(self, reader: CheckpointReader, layer: int) -> None:
        self.reader, self.src = reader, f"model.layers.{layer}."

    def _name(self, name: str) -> str:
        if name.startswith("model.layers.0."):
            return self.src + name.removeprefix("model.layers.0.")
        if name == "model.norm.weight":
            return self.src + "shared_head.norm.weight"
        if name == "lm_head.weight":
            own = self.src + "shared_head.head.weight"
            return own if own in self.reader else name
        if name == "model.embed_tokens.weight":
            own = self.src + "embed_tokens.weight"
            return own if own in self.reader else name
        return name

    def take(self, name: str, split: Split | None = None) -> torch.Tensor:
        return self.reader.take(self._name(name), split)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._name(name) in self.reader


def load_mtp(loaded: LoadedModel, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """The first MTP module of ``loaded``'s checkpoint (DeepSeek-V3's ``num_nextn_predict_layers``)
    as a one-layer :class:`~engine_workers.model.models.mtp.MtpForPagedLM`, in ``dtype`` (plain
    torch linears: it runs a few rows per step). ModelError naming what is missing."""
    from engine_workers.model.models.mtp import MtpForPagedLM, mtp_spec

    path = Path(loaded.path)
    n = getattr(loaded.hf_config, "num_nextn_predict_layers", None) or getattr(loaded.hf_config, "num_mtp_layers", None)
    if not n:
        raise ModelError(f"model {path} has no MTP layers (its config has no num_nextn_predict_layers): "
                         "speculative method 'mtp' needs a checkpoint that carries them")
    spec = mtp_spec(loaded.spec)
    layer = loaded.spec.num_layers
    with CheckpointReader(path, loaded.spec) as reader:
        names = _MtpNames(reader, layer)
        if f"model.layers.{layer}.eh_proj.weight" not in reader:
            raise ModelError(f"weights of {path} lack the MTP module model.layers.{layer}.* "
                             f"(num_nextn_predict_layers={n})")
        state = _map_state(names, spec, path)
        for ours in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            state[ours] = reader.take(f"model.layers.{layer}.{ours}")
    with torch.device("meta"):
        model = MtpForPagedLM(spec)
    model = _materialize(model, state, spec, dtype, device, f"weights of {path}: the MTP module")
    model.set_ropes(loaded.hf_config, loaded.spec.max_position_embeddings, device)
    return LoadedModel(path, model, spec, loaded.tokenizer, loaded.hf_config, loaded.eos_token_ids)


M = TypeVar("M", bound=torch.nn.Module)


def _materialize(model: M, state: dict[str, torch.Tensor], spec, dtype: torch.dtype, device: torch.device | str,
                 what: str) -> M:
    """``model`` (built on the meta device) given the checked weights of ``state``: every parameter
    present with its shape (a :class:`ModelError` naming ``what`` otherwise), in ``dtype`` but for
    those :func:`_keep_fp32` keeps, on ``device``, in eval mode, frozen."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for name, shape in expected.items():
        if name not in state:
            raise ModelError(f"{what} lacks {name}")
        if tuple(state[name].shape) != tuple(shape):
            raise ModelError(f"{what}: {name} has shape {tuple(state[name].shape)}, expected {tuple(shape)}")
    model.load_state_dict({k: v.float() if _keep_fp32(k, spec) else v.to(dtype) for k, v in state.items() if k in expected},
                          assign=True)
    model = model.to(device=device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _keep_fp32(name: str, spec: ModelSpec) -> bool:
    """DeepSeek-V3's router weight and selection bias stay float32 in any model dtype, as its
    reference keeps them: top-k over sigmoid scores that differ in the third digit."""
    return (spec.moe is not None and spec.moe.router.kind == "sigmoid_group"
            and name.endswith(("mlp.router.weight", "mlp.router.correction")))


def _experts(model: LlamaForPagedLM) -> list[GroupedExperts]:
    """The model's expert stacks (routed and shared), listed before any is changed."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def quantize_linears(model: LlamaForPagedLM, kind: str) -> None:
    """Every linear layer (and the head) of a float32 model onto the ``kind`` weight format
    (``int8``, ``bfloat16`` or ``w8a8``), in place: what :func:`load_model`'s ``lowp`` does after
    loading, for a caller that changes the float32 model first (model/smoothing.py)."""
    _lowp(model, kind)


def _lowp(model: LlamaForPagedLM, kind: str) -> None:
    from engine_workers.kernels import lowp_kernels
    from engine_workers.kernels.cpu_linear import LowpLinear, replace_linears
    from engine_workers.kernels.w8a8_linear import W8A8GatedMLP, W8A8Linear, w8a8_ops

    make: Callable[[torch.Tensor, torch.Tensor | None], torch.nn.Module]
    if kind == "w8a8":
        ops = w8a8_ops()
        make, acts = (lambda w, b: W8A8Linear.from_weight(w, b, ops)), "int8 per row"
    elif kind == "bfloat16":  # on AMX tiles where the ISA level has them (cpu_linear.bf16_layer)
        from engine_workers.kernels.amx_linear import amx
        from engine_workers.kernels.cpu_linear import bf16_layer

        lowp_ops = None if amx() else lowp_kernels.lowp()
        make, acts = (lambda w, b: bf16_layer(w, b, lowp_ops)), ("bf16 (AMX tiles)" if amx() else "float32")
    else:
        lowp_ops = lowp_kernels.lowp()
        make, acts = (lambda w, b: LowpLinear.from_weight(kind, w, b, lowp_ops)), "float32"
    n = replace_linears(model, lambda lin: make(lin.weight, lin.bias))
    # MoE experts too (routed and shared): each expert's two layers on the same kernel, w8a8 SiLU
    # experts fused as the dense MLP is
    gated = (lambda gu, dn: W8A8GatedMLP(gu, dn)) if kind == "w8a8" else None
    n += sum(m.use_linears(make, gated) for m in _experts(model))
    if kind == "w8a8":
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            mlp = layer.mlp
            if (isinstance(mlp, MLP) and mlp.activation == "silu" and isinstance(mlp.gate_up_proj, W8A8Linear)
                    and isinstance(mlp.down_proj, W8A8Linear)):
                mlp.gated = W8A8GatedMLP(mlp.gate_up_proj, mlp.down_proj)
    if model.lm_head is None:  # tied: a low-precision copy of the embedding matrix as the head
        model.lm_head = make(model.embed_tokens.weight, None)
        n += 1
    from engine_workers.kernels.amx_linear import AmxLinear

    size = sum(m.weight_bytes() for m in model.modules() if isinstance(m, (LowpLinear, W8A8Linear, AmxLinear)))
    log.info("%d linear layers with %s weights (%.0f MB) on the engine's CPU kernels; activations %s",
             n, kind, size / 1e6, acts)


def _blocks(model: LlamaForPagedLM, path: Path) -> None:
    """Every linear layer (and the head) onto :class:`engine_workers.kernels.cpu_blocks.BlockLinear`:
    Q4_1 layers and a Q8_0 head. Where ``path`` was converted from a GGUF whose blocks dequantize
    to exactly the float32 weights just loaded, those blocks are used as they are (the model's
    numerics unchanged but for summation order); otherwise, or for a layer the GGUF lacks, the
    float32 weight is quantized here. Logs which."""
    from engine_workers.kernels.cpu_blocks import BlockLinear
    from engine_workers.model.loading.gguf_blocks import gguf_source, layer_blocks

    linears: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
        name: (mod.weight, mod.bias) for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    if model.lm_head is None:  # tied: the head is a copy of the embedding matrix (which stays float32)
        linears["lm_head"] = (model.embed_tokens.weight, None)
    source, blocks = gguf_source(path), {}
    if source is not None:
        try:
            blocks = layer_blocks(source, model.spec)
        except ModelError as exc:
            log.warning("q4_1: not using the GGUF's blocks (%s); quantizing at load", exc)
    made: dict[str, BlockLinear] = {}
    for name, b in blocks.items():
        if name in linears and b.shape == tuple(linears[name][0].shape):
            made[name] = BlockLinear.from_blocks(b, linears[name][1])
    # The folder's float32 weights are what the model is; the GGUF's blocks stand in for them only
    # where they dequantize to exactly those weights (an edited folder, another GGUF: quantize here).
    wrong = [name for name, lin in made.items() if not torch.equal(lin.dequantized(), linears[name][0])]
    if wrong:
        log.warning("q4_1: %d of %s's tensors (first %s) do not dequantize to %s's weights; quantizing at load",
                    len(wrong), source, wrong[0], path)
        made = {}
    from_gguf = len(made)
    for name, (weight, bias) in linears.items():
        if name not in made:
            made[name] = BlockLinear.quantized("q8_0" if name == "lm_head" else "q4_1", weight, bias)
    for name, lin in made.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, lin)
    # MoE experts (routed and shared): Q4_1, quantized here (the GGUF's expert tensors are not read)
    experts = sum(m.use_linears(lambda w, b: BlockLinear.quantized("q4_1", w, b)) for m in _experts(model))
    size = sum(m.weight_bytes() for m in model.modules() if isinstance(m, BlockLinear))
    if experts:
        log.info("%d MoE expert layers quantized to Q4_1 at load", experts)
    log.info("%d linear layers on the engine's CPU block kernel (Q4_1, head %s; %.0f MB): %d from the GGUF's "
             "blocks (%s), %d quantized at load; activations float32",
             len(made), made["lm_head"].kind, size / 1e6, from_gguf, source, len(made) - from_gguf)


def _prepack(model: LlamaForPagedLM, device: torch.device, dtype: torch.dtype, cpu_kernels: bool = True) -> None:
    from engine_workers.kernels.cpu_linear import (
        SMALL_M_MAX,
        PackedLinear,
        available_memory,
        packing_problem,
        panel_bytes,
        prepack_linears,
    )

    problem = packing_problem(device, dtype)
    if problem is not None:
        if device.type == "cpu" and dtype == torch.float32:  # expected elsewhere; worth a word here
            log.warning("linear layers stay on F.linear: %s", problem)
        return
    small_m = None
    if cpu_kernels:
        from engine_workers.kernels import cpu_kernels as kernels

        small_m = kernels.small_m()
        if small_m is not None:
            weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
            if model.lm_head is None:
                weights.append(model.embed_tokens.weight)
            need, avail = panel_bytes(weights), available_memory()
            if avail is not None and need > avail // 4:
                log.warning("small-batch linear kernel off: its weight copies need %.1f GiB, more than a "
                            "quarter of the %.1f GiB available", need / 2**30, avail / 2**30)
                small_m = None
    n = prepack_linears(model, small_m)
    if model.lm_head is None:  # tied: a packed copy of the embedding matrix as the head
        model.lm_head = PackedLinear.from_weight(model.embed_tokens.weight, small_m=small_m)
        n += 1
    if small_m is not None:
        log.info("%d linear layers packed for oneDNN (CPU float32); batches of <= %d rows on the small-batch "
                 "kernel", n, SMALL_M_MAX)
    else:
        log.info("%d linear layers packed for oneDNN (CPU float32)", n)


def _map_state(t: WeightSource | dict[str, torch.Tensor], spec: ModelSpec, path: Path) -> dict[str, torch.Tensor]:
    """HF parameter names -> ours, fusing q/k/v and gate/up; q and k rows (and q/k norms) are
    reordered to the interleaved RoPE layout (:func:`engine_workers.model.models.llama.interleave_rope_rows`).
    Every tensor taken is tagged with how a tensor-parallel rank splits it (a
    :class:`~engine_workers.model.loading.sharding.slices.Split`; None: replicated); a rank's reader returns
    only its slices and ``spec`` is then the rank's local one, so the shapes below are its own."""
    src_t = t if not isinstance(t, dict) else DictSource(t, path)
    d = spec.head_dim
    HEADS, KV, INTER = Split("heads"), Split("kv"), Split("inter")

    def rope_rows(name: str, heads: int, split: Split | None) -> torch.Tensor:
        w = take(name, split)
        if w.shape[0] != heads * d:  # reordering needs the configured shape; say so before it fails
            raise ModelError(f"weights of {path}: {name} has shape {tuple(w.shape)}, expected {heads * d} rows")
        return interleave_rope_rows(w, heads, d)

    def take(name: str, split: Split | None = None) -> torch.Tensor:
        return src_t.take(name, split)

    out = {"embed_tokens.weight": take("model.embed_tokens.weight", Split("vocab")),
           "norm.weight": take("model.norm.weight")}
    if not spec.tie_word_embeddings:
        # untied: a head of its own, never the embedding
        out["lm_head.weight"] = take("lm_head.weight", Split("vocab"))
    fused = spec.model_type == "phi3"  # Phi-3 checkpoints store qkv_proj and gate_up_proj fused
    for i in range(spec.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        if spec.mla is not None:
            out.update(map_mla_state(take, spec.mla, src, dst))
        for kind in (() if spec.mla is not None else ("weight", "bias") if spec.attention_bias else ("weight",)):
            if fused:
                qkv = take(attn + f"qkv_proj.{kind}", Split("qkv"))
                q_rows, kv_rows = spec.num_heads * d, spec.num_kv_heads * d
                if qkv.shape[0] != q_rows + 2 * kv_rows:
                    raise ModelError(f"weights of {path}: {attn}qkv_proj.{kind} has shape {tuple(qkv.shape)}, "
                                     f"expected {q_rows + 2 * kv_rows} rows")
                q_w, k_w, v_w = qkv.split([q_rows, kv_rows, kv_rows])
                q = interleave_rope_rows(q_w, spec.num_heads, d)
                k = interleave_rope_rows(k_w, spec.num_kv_heads, d)
            else:
                q = rope_rows(attn + f"q_proj.{kind}", spec.num_heads, HEADS)
                k = rope_rows(attn + f"k_proj.{kind}", spec.num_kv_heads, KV)
                v_w = take(attn + f"v_proj.{kind}", KV)
            out[dst + f"self_attn.qkv_proj.{kind}"] = torch.cat([q, k, v_w])
        if spec.mla is None:
            out[dst + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight", Split("heads", dim=1))
        if spec.o_proj_bias and spec.mla is None:
            out[dst + "self_attn.o_proj.bias"] = take(attn + "o_proj.bias")
        if spec.attn_sinks:
            out[dst + "self_attn.sinks"] = take(attn + "sinks", Split("sinks"))
        if spec.qk_norm:
            # [head_dim] per-dimension scales: the same reordering as the rows they scale
            out[dst + "self_attn.q_norm.weight"] = rope_rows(attn + "q_norm.weight", 1, None)
            out[dst + "self_attn.k_norm.weight"] = rope_rows(attn + "k_norm.weight", 1, None)
        if spec.qk_norm_full:  # [heads * head_dim] scales over the whole projection (never split: layout)
            out[dst + "self_attn.q_norm_full.weight"] = rope_rows(attn + "q_norm.weight", spec.num_heads, None)
            out[dst + "self_attn.k_norm_full.weight"] = rope_rows(attn + "k_norm.weight", spec.num_kv_heads, None)
        mlp = src + "mlp."
        if spec.moe is not None and spec.moe.sparse_layers[i]:
            out.update(map_moe_state(take, src_t.__contains__, spec.moe, src, dst))
        elif fused:
            out[dst + "mlp.gate_up_proj.weight"] = take(mlp + "gate_up_proj.weight", Split("gated"))
        else:
            out[dst + "mlp.gate_up_proj.weight"] = torch.cat([take(mlp + "gate_proj.weight", INTER),
                                                              take(mlp + "up_proj.weight", INTER)])
        if not (spec.moe is not None and spec.moe.sparse_layers[i]):
            out[dst + "mlp.down_proj.weight"] = take(mlp + "down_proj.weight", Split("inter", dim=1))
        if spec.mlp_bias:
            out[dst + "mlp.gate_up_proj.bias"] = torch.cat([take(mlp + "gate_proj.bias", INTER),
                                                            take(mlp + "up_proj.bias", INTER)])
            out[dst + "mlp.down_proj.bias"] = take(mlp + "down_proj.bias")
        for ours, theirs in _norm_names(spec).items():
            out[dst + ours] = take(src + theirs)
    if spec.norm_offset:  # Gemma's RMSNorm scales by (1 + w): fold the 1 in once, here
        for name in [n for n in out if n.endswith("norm.weight") or "_norm" in n]:
            out[name] = out[name].float() + 1.0
    return out


def _norm_names(spec: ModelSpec) -> dict[str, str]:
    """Our per-layer norm parameters -> the checkpoint's (engine_workers.model.models.llama.DecoderLayer)."""
    if spec.model_type in ("gemma2", "gemma3_text"):  # the sandwich: pre and post of both attention and MLP
        return {"input_layernorm.weight": "input_layernorm.weight",
                "attn_out_norm.weight": "post_attention_layernorm.weight",
                "post_attention_layernorm.weight": "pre_feedforward_layernorm.weight",
                "mlp_out_norm.weight": "post_feedforward_layernorm.weight"}
    if spec.model_type == "olmo2":  # post-norms only: HF's post_attention_layernorm norms the output
        return {"attn_out_norm.weight": "post_attention_layernorm.weight",
                "mlp_out_norm.weight": "post_feedforward_layernorm.weight"}
    return {"input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "post_attention_layernorm.weight"}


def _eos_ids(path: Path, hf_config, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json, then config, then the tokenizer (all of them, deduped)."""
    ids: list[int] = []

    def add(v) -> None:
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, int) and x not in ids:
                ids.append(x)

    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError):
            log.warning("ignoring unreadable %s", gen)
    add(getattr(hf_config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(ids)
