"""Activation smoothing for ``--quantization w8a8`` (SmoothQuant's per-channel migration), applied to
the float32 model before its linear layers are quantized.

Why: w8a8 quantizes each input row of a linear layer to int8 with one scale, ``max|row| / 127``.
The inputs of these models have a few outlier channels (tens of times the rest), so the rounding
step is coarse for every other channel, and which way an element rounds is decided by its last
bits. A last-bit change anywhere upstream (another ISA level's summation order, another host's
kernels) flips roundings that the layers then amplify: measured on SmolLM2-135M, 8 perturbations
of the embeddings by 2e-7 moved w8a8's next-token logits error against float32 between 0.067
and 0.129 (rel L2), the error of one host differing from another's by chance (docs/benchmarks.md,
"w8a8 across hosts"). Dividing each input channel ``j`` by ``s_j`` and multiplying the weight's
column ``j`` by it leaves the float32 product unchanged and moves the outliers into the weights
(quantized per output row, where one large column costs little): the step shrinks for the
ordinary channels and the error and its spread fall (same measurement: 0.045-0.077).

``s_j = max|x_j| ** alpha / max|W_:,j| ** (1 - alpha)`` (alpha 0.5), with ``max|x_j|`` measured
on :data:`CALIBRATION` (a fixed text: the factors, so the logits, are the same on every worker
that runs the same model, mode and kernels, as exact resume needs). The division is folded,
so nothing is added to a forward:
* q/k/v and gate/up inputs: into the RMSNorm before them (pre-norm families only);
* down_proj's input ``act(gate) * up``: into up's rows (the product is linear in up);
* o_proj's input, the attention output: into v's rows, one factor per KV channel shared by the
  query heads that read it (GQA).
A layer that does not have that shape (MoE experts, MLA, post-norm families) is left as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine_workers.model.execution.batch import Chunk, ModelInput
from engine_workers.model.execution.runner import ModelRunner
from engine_workers.model.loading.loader import LoadedModel, load_model, quantize_linears
from engine_workers.model.models.llama import MLP, Attention, DecoderLayer, LlamaForPagedLM, RMSNorm

log = logging.getLogger(__name__)

ALPHA = 0.5  # SmoothQuant's default migration strength; 0.65 and 0.8 measured worse here
CALIBRATION_TOKENS = 512
_FLOOR = 1e-5  # a channel that never fired (or an all-zero weight column) keeps a finite factor

# Calibration text: mixed prose, dialogue, code and numbers, written for this purpose. What
# matters is that it drives the outlier channels as real prompts do (they fire on the first
# token and on delimiters whatever the text), not its topic.
CALIBRATION = """\
The harbour was quiet before dawn. Fishing boats rocked against the pier, their lamps still lit,
and a gull walked the length of the railing as if it owned the town. By seven the market opened:
bread, salted cod, oranges from the south, and a stall that sold nothing but string.

Q: How many minutes are there in three and a half hours?
A: Three hours are 180 minutes and half an hour is 30, so 210 minutes in all.

Q: Can you explain what a hash table is, briefly?
A: A hash table stores key-value pairs in an array. A hash function turns each key into an
index; collisions are handled by chaining or open addressing. Lookups take constant time on
average.

def merge(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (id) GROUP BY name;

Dear Ms. Alvarez, thank you for your letter of 14 March. The parts you ordered (No. 4417-B,
quantity 12) will ship on Friday; the invoice total is EUR 1,286.40 including tax.

Bonjour, je voudrais un cafe et deux croissants, s'il vous plait. Guten Morgen! Wie geht's?

Summary: the committee met twice, approved the budget (7 votes to 2), and asked the treasurer
to report again in June. Action items: update the website; book the hall; email the members.
"""


@dataclass(frozen=True, slots=True)
class SmoothingReport:
    layers: int  # decoder layers smoothed
    linears: int  # linear layers whose input was smoothed
    tokens: int  # calibration tokens


def calibration_ids(tokenizer, limit: int = CALIBRATION_TOKENS) -> list[int]:
    """:data:`CALIBRATION` as the model reads it: in its chat template where it has one (the
    template's delimiters are where outlier channels fire hardest), else plain."""
    half = len(CALIBRATION) // 2
    ids: Sequence[int]
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": CALIBRATION[:half]}, {"role": "assistant", "content": CALIBRATION[half:]}]
        try:
            ids = tokenizer.apply_chat_template(msgs, tokenize=True)
        except Exception:  # a template that refuses these roles: the plain text serves as well
            ids = tokenizer.encode(CALIBRATION)
    else:
        ids = tokenizer.encode(CALIBRATION)
    if not isinstance(ids, list):  # a BatchEncoding from newer transformers
        ids = ids["input_ids"]  # type: ignore[call-overload]
    return [int(t) for t in ids][:limit]


def _targets(model: LlamaForPagedLM) -> list[tuple[int, DecoderLayer, Attention, MLP | None]]:
    """The decoder layers whose inputs can be smoothed: (index, layer, its attention, its dense
    MLP or None for MoE)."""
    if model.spec.mla is not None or not model.spec.pre_norms:
        return []
    out = []
    for i, layer in enumerate(model.layers):
        if isinstance(layer, DecoderLayer) and isinstance(layer.self_attn, Attention):
            out.append((i, layer, layer.self_attn, layer.mlp if isinstance(layer.mlp, MLP) else None))
    return out


def input_maxima(model: LlamaForPagedLM, forward: Callable[[], object]) -> dict[str, torch.Tensor]:
    """Per input channel, the largest ``|x|`` each smoothable linear layer sees while ``forward()``
    runs the calibration text, keyed by module name."""
    stats: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable:
        def record(_mod: nn.Module, inp: tuple[torch.Tensor, ...], _out: object) -> None:
            x = inp[0].detach()
            m = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
            stats[name] = torch.maximum(stats[name], m) if name in stats else m
        return record

    handles = []
    for i, _layer, attn, mlp in _targets(model):
        mods: dict[str, nn.Module] = {"qkv": attn.qkv_proj, "o": attn.o_proj}
        if mlp is not None:
            mods |= {"gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        handles += [m.register_forward_hook(hook(f"{i}.{k}")) for k, m in mods.items()]
    try:
        forward()
    finally:
        for h in handles:
            h.remove()
    return stats


def _factors(act: torch.Tensor, weight_col_max: torch.Tensor, alpha: float) -> torch.Tensor:
    # Not rounded to powers of two (which would keep the folded float32 model bit-exact): measured
    # on SmolLM2, rounding them raised w8a8's mean error by a fifth. The factors are a function of
    # the model, the fixed text and the host's float32 kernels, so equal on equal workers.
    return (act.clamp_min(_FLOOR) ** alpha / weight_col_max.clamp_min(_FLOOR) ** (1 - alpha)).clamp_min(_FLOOR)


@torch.no_grad()
def smooth(model: LlamaForPagedLM, stats: dict[str, torch.Tensor], tokens: int, alpha: float = ALPHA) -> SmoothingReport:
    """Fold the smoothing factors of ``stats`` (:func:`input_maxima`) into the float32 weights, in
    place. The model computes the same function (to float32 rounding) afterwards."""
    layers = linears = 0
    for i, layer, attn, mlp in _targets(model):
        norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
        done = 0
        if f"{i}.qkv" in stats and isinstance(norm_in, RMSNorm):
            s = _factors(stats[f"{i}.qkv"], attn.qkv_proj.weight.abs().amax(0), alpha)
            norm_in.weight.div_(s)
            attn.qkv_proj.weight.mul_(s)
            done += 1
        if f"{i}.o" in stats:
            # channel h * d + e of o_proj's input is v's channel (h // g) * d + e: one factor per
            # KV channel, the largest need of the query heads sharing it
            g, d, hkv = attn.hq // attn.hkv, attn.d, attn.hkv
            act = stats[f"{i}.o"].view(hkv, g, d).amax(1)
            wmax = attn.o_proj.weight.abs().amax(0).view(hkv, g, d).amax(1)
            s = _factors(act, wmax, alpha).reshape(-1)
            v0 = attn.q_size + attn.kv_size
            attn.qkv_proj.weight[v0:].div_(s[:, None])
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias[v0:].div_(s)
            attn.o_proj.weight.mul_(s.view(hkv, 1, d).expand(hkv, g, d).reshape(-1))
            done += 1
        if mlp is not None and f"{i}.gate_up" in stats and isinstance(norm_post, RMSNorm):
            s = _factors(stats[f"{i}.gate_up"], mlp.gate_up_proj.weight.abs().amax(0), alpha)
            norm_post.weight.div_(s)
            mlp.gate_up_proj.weight.mul_(s)
            done += 1
        if mlp is not None and f"{i}.down" in stats:
            s = _factors(stats[f"{i}.down"], mlp.down_proj.weight.abs().amax(0), alpha)
            mlp.gate_up_proj.weight[mlp.inter:].div_(s[:, None])  # up's rows: act(gate) * up / s
            if mlp.gate_up_proj.bias is not None:
                mlp.gate_up_proj.bias[mlp.inter:].div_(s)
            mlp.down_proj.weight.mul_(s)
            done += 1
        layers += done > 0
        linears += done
    report = SmoothingReport(layers, linears, tokens)
    log.info("w8a8: activation smoothing (alpha %.2f, %d calibration tokens) folded into %d linear layers of %d "
             "decoder layers", alpha, tokens, linears, layers)
    return report


def load_smoothed_w8a8(spec: str | Path | None, device: torch.device, block_size: int, max_len: int | None = None,
                       cpu_kernels: bool = True) -> LoadedModel:
    """Load ``spec`` for ``--quantization w8a8`` (single rank): float32 first, the calibration text
    run through it on a throwaway runner (a cache of just its blocks, nothing shared) to measure
    the inputs, the smoothing folded in, then the linear layers quantized."""
    loaded = load_model(spec, torch.float32, device, max_len, weight_prepack=False, cpu_kernels=cpu_kernels)
    ids = calibration_ids(loaded.tokenizer)
    if ids:
        blocks = -(-len(ids) // block_size)
        probe = ModelRunner(loaded, blocks, block_size, device, torch.float32, cpu_kernels, torch.float32)
        stats = input_maxima(loaded.model, lambda: probe.execute(ModelInput((Chunk(ids, 0, list(range(blocks)), True),))))
        del probe
        smooth(loaded.model, stats, len(ids))
    quantize_linears(loaded.model, "w8a8")
    return loaded
