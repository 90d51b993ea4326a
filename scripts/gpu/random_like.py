"""Write a randomly initialised checkpoint with a real model's shape: ``random_like.py SRC OUT``.

SRC holds a model's config.json and tokenizer files (no weights); OUT gets the same files and
random weights (``save_pretrained``). Speed does not depend on the weights' values, so a GPU machine
that cannot fetch the default model (nothing there reaches a hub, and the weights are too large to
carry) still benchmarks the engine at the default model's exact shape.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(src: str, out: str) -> None:
    src_p, out_p = Path(src), Path(out)
    out_p.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(src_p)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_p)
    for f in src_p.iterdir():
        if f.name != "config.json" and f.is_file():
            shutil.copy(f, out_p / f.name)
    n = sum(p.numel() for p in model.parameters())
    print(f"random {config.model_type} with {n / 1e6:.1f}M parameters, {config.num_hidden_layers} layers -> {out_p}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
