"""The LoRA flags, vLLM's names, each with a ``LOCKGATE_*`` twin (docs/lora.md): shared by every
engine-building command through :func:`lockgate.options.add_engine_args`, and ``--lora-modules``
by the edge too (the adapter names it routes when no heartbeat has named them yet)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path`` -> ``(name, path)``; a bare ``name`` (edge: a name only) -> ``(name, "")``."""
    name, sep, path = str(text).partition("=")
    name = name.strip()
    if not name or (sep and not path.strip()):
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path, got {text!r}")
    return name, path.strip()


def _env_modules() -> list[tuple[str, str]]:
    raw = os.environ.get("LOCKGATE_LORA_MODULES", "")
    return [parse_lora_module(t) for t in raw.split()]


def add_lora_module_arg(g: Any, help_text: str) -> None:
    g.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=_env_modules(), metavar="NAME=PATH",
                   help=help_text + " [LOCKGATE_LORA_MODULES, space-separated]")


def add_lora_args(p: argparse.ArgumentParser, env_default: Callable[[str, object], object]) -> None:
    """The engine's LoRA flags; ``env_default``: :func:`lockgate.options.env_default` (passed in, as
    that module adds these flags to its own)."""
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", default=env_default("enable-lora", False),
                   help="serve LoRA adapters beside the base model (PEFT format; docs/lora.md) [LOCKGATE_ENABLE_LORA]")
    add_lora_module_arg(g, "adapters a request may name as its model: name=path of a PEFT adapter folder "
                           "(adapter_config.json + adapter_model.safetensors); needs --enable-lora")
    g.add_argument("--max-loras", type=int, default=env_default("max-loras", 1),
                   help="distinct adapters one batch may mix (the model's adapter slots); requests for more "
                        "wait their turn; default 1, as vLLM [LOCKGATE_MAX_LORAS]")
    g.add_argument("--max-lora-rank", type=int, default=env_default("max-lora-rank", 16),
                   help="the largest adapter rank accepted; default 16, as vLLM [LOCKGATE_MAX_LORA_RANK]")
    g.add_argument("--max-cpu-loras", type=int, default=env_default("max-cpu-loras", None),
                   help="loaded adapters kept in host memory (LRU; an evicted one is read again on use); "
                        "default: --max-loras [LOCKGATE_MAX_CPU_LORAS]")


def lora_config(args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA fields of ``EngineConfig`` from parsed flags (absent flags: LoRA off)."""
    modules = tuple(getattr(args, "lora_modules", None) or ())
    missing = [name for name, path in modules if not path]
    if missing:
        raise ValueError(f"--lora-modules {missing[0]}: an engine needs name=path")
    return dict(enable_lora=getattr(args, "enable_lora", False), lora_modules=modules,
                max_loras=getattr(args, "max_loras", 1), max_lora_rank=getattr(args, "max_lora_rank", 16),
                max_cpu_loras=getattr(args, "max_cpu_loras", None))
