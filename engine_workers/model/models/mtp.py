"""DeepSeek-V3's multi-token-prediction (MTP) module as a one-layer paged model, for speculation.

A checkpoint with ``num_nextn_predict_layers`` stores, after its ``num_hidden_layers`` decoder
layers, a module per predicted depth (``model.layers.{L}.*``; lockgate uses the first): ``enorm``
and ``hnorm`` (RMSNorms), ``eh_proj`` (``[hidden, 2 * hidden]``), one decoder layer like the
model's own (MLA attention, MoE MLP), and ``shared_head.norm`` / ``shared_head.head`` (the final
norm and the LM head; an ``embed_tokens`` of its own, equal to the model's). At position ``i`` it
reads the target's last hidden state ``h_i`` (before the final norm) and the embedding of token
``t_{i+1}``; its output there predicts ``t_{i+2}``:

    x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]);  s = layer(x);  logits = head(norm(s))

``s`` (before the norm) stands in for the target's hidden state when the module is chained to
propose a second token and more (as vLLM chains it). The module is a :class:`LlamaForPagedLM`
of one layer whose first-layer input is that projection instead of the embedding, so it runs on
the same runner, paged cache and kernels as any model; the caller sets :attr:`prev_hidden` (the
``h`` rows, aligned with the input tokens) before each forward.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine_workers.model.models.llama import LlamaForPagedLM, RMSNorm
from engine_workers.model.models.spec import ModelSpec


def mtp_spec(spec: ModelSpec) -> ModelSpec:
    """The one-layer spec of ``spec``'s MTP module: its layer is built as a sparse layer when the
    model's last layer is one (DeepSeek-V3's MTP layer is MoE)."""
    moe = spec.moe
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=(moe.sparse_layers[-1],))
    windows = spec.layer_windows[-1:] if spec.layer_windows else ()
    return dataclasses.replace(spec, num_layers=1, moe=moe, layer_windows=windows)


class MtpForPagedLM(LlamaForPagedLM):
    def __init__(self, spec: ModelSpec) -> None:
        """``spec``: the one-layer spec (:func:`mtp_spec`)."""
        super().__init__(spec)
        h = spec.hidden_size
        self.enorm = RMSNorm(h, spec.rms_norm_eps)
        self.hnorm = RMSNorm(h, spec.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.prev_hidden: torch.Tensor | None = None  # [T, hidden]: set by the caller before each forward

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        prev = self.prev_hidden
        if prev is None or prev.shape[0] != input_ids.shape[0]:
            raise ValueError("MTP forward: prev_hidden must hold one hidden state per input token")
        e = self.enorm(self.embed_tokens(input_ids))
        return self.eh_proj(torch.cat([e, self.hnorm(prev.to(e.dtype))], dim=-1))
