"""Adapters made with ``peft`` itself on a base checkpoint folder, with non-zero B (PEFT's
``init_lora_weights=False``: A and B both random), so every adapter changes the outputs."""

from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(base_dir: str, out: Path, targets: list[str], *, r: int = 4, alpha: float = 8.0,
                 rslora: bool = False, seed: int = 0, b_scale: float = 1.0, **extra) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False,
                     lora_dropout=0.0, **extra)
    model = get_peft_model(base, cfg)
    if b_scale != 1.0:  # a gentler adapter for a real model, whose outputs should stay sensible
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(b_scale)
    model.save_pretrained(str(out))
    return out


def hf_with_adapter(base_dir: str, adapter: Path | None, merged: bool = False):
    """transformers + peft, unmerged (the adapter runs beside the base layers, as PEFT serves it),
    or with ``merged`` folded into the base weights (``merge_and_unload``)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter is None:
        return base
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    return model.merge_and_unload().eval() if merged else model
