"""Read and check a PEFT ``adapter_config.json``.

PEFT writes some thirty fields, nearly all at their defaults. A field is refused only when its
value changes the math and lockgate does not implement it (DoRA, trained biases, modules lockgate
lacks, ...): the error names the field and the value. A field at its default, or one that only
matters for training (dropout, init, ``inference_mode``), is accepted whatever it says. A field
this code has never heard of is logged and ignored (PEFT adds fields; refusing every new one would
refuse adapters whose math is plain LoRA).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class LoraError(ValueError):
    """An adapter lockgate cannot serve: the message names the adapter, the field and the value."""


# training-only or bookkeeping fields: any value leaves the served math unchanged
_HARMLESS = frozenset({
    "peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "lora_dropout",
    "init_lora_weights", "auto_mapping", "target_modules", "exclude_modules", "layers_to_transform",
    "layers_pattern", "megatron_core", "loftq_config", "eva_config", "corda_config", "r", "lora_alpha",
    "use_rslora", "rank_pattern", "alpha_pattern", "bias", "fan_in_fan_out", "use_dora", "modules_to_save",
    "layer_replication", "lora_bias", "trainable_token_indices", "use_qalora", "qalora_group_size",
    "target_parameters", "megatron_config", "runtime_config", "alora_invocation_tokens", "arrow_config",
    "ensure_weight_tying", "peft_version",
    "lora_ga_config", "velora_config",  # an initialisation (LoRA-GA), a training-memory scheme (VeLoRA)
})

# field -> (what means "off", why it is refused when on): a value other than "off" changes the math
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_dora": ((False, None), "DoRA (weight-decomposed LoRA) is not implemented"),
    "bias": (("none", None), "trained biases are not implemented (only bias='none')"),
    "lora_bias": ((False, None), "a bias on lora_B is not implemented"),
    "fan_in_fan_out": ((False, None), "transposed (Conv1D) weights are not implemented"),
    "modules_to_save": ((None, []), "fully trained extra modules are not implemented"),
    "layer_replication": ((None, []), "layer replication is not implemented"),
    "trainable_token_indices": ((None, [], {}), "trained token embeddings are not implemented"),
    "use_qalora": ((False, None), "QA-LoRA is not implemented"),
    "target_parameters": ((None, []), "LoRA on raw parameters (MoE experts) is not implemented"),
    "alora_invocation_tokens": ((None, []), "activated LoRA (aLoRA) is not implemented"),
    "arrow_config": ((None, {}), "Arrow routing is not implemented"),
    "megatron_config": ((None, {}), "Megatron-parallel LoRA layers are not implemented"),
    # variants PEFT configures through the LoRA config; each changes the layer's forward or is not
    # known to leave it alone, and none is implemented
    "use_bdlora": ((False, None), "block-diagonal LoRA is not implemented"),
    "kasa_config": ((None, {}), "KaSA is not implemented"),
    "monteclora_config": ((None, {}), "MonteCLoRA is not implemented"),
    "astra_config": ((None, {}), "this LoRA variant (astra_config) is not implemented"),
}


@dataclass(frozen=True, slots=True)
class PeftLoraConfig:
    """The fields that shape the served math. ``scale(module, rank)`` is PEFT's ``scaling``."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: tuple[tuple[str, int], ...]
    alpha_pattern: tuple[tuple[str, float], ...]

    def scale(self, module: str, rank: int) -> float:
        """``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``) for the module named ``module`` (the
        checkpoint's dotted name), whose weights have ``rank`` rows in lora_A. ``alpha_pattern``
        keys match a module as PEFT matches them (the name ends with the key, at a dot)."""
        alpha = _pattern_value(self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_value(pattern: tuple[tuple[str, Any], ...], module: str, default: Any) -> Any:
    for key, value in pattern:
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(path: Path, name: str) -> PeftLoraConfig:
    """``path/adapter_config.json`` checked (module docstring); ``name`` the adapter's served name,
    for messages."""
    file = path / "adapter_config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoraError(f"LoRA adapter {name!r}: {file} does not exist") from None
    except (OSError, ValueError) as exc:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {file}: {exc}") from None
    if not isinstance(raw, dict):
        raise LoraError(f"LoRA adapter {name!r}: {file} is not a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type={peft_type!r} is not a LoRA adapter (only LORA)")
    for field, (off, why) in _REFUSED.items():
        value = raw.get(field)
        if field in raw and value not in off:
            raise LoraError(f"LoRA adapter {name!r}: {field}={value!r}: {why}")
    # a field this build has never heard of: ignored, and worth a word only when it is set to
    # something (None, False, empty: surely its default)
    unknown = sorted(k for k, v in raw.items() if k not in _HARMLESS and k not in _REFUSED and v not in (None, False, "", [], {}))
    if unknown:
        log.warning("LoRA adapter %r: ignoring fields this lockgate does not know: %s", name, ", ".join(unknown))
    r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError(f"LoRA adapter {name!r}: r={r!r} must be an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraError(f"LoRA adapter {name!r}: lora_alpha={alpha!r} must be a finite number")
    patterns = {}
    for field in ("rank_pattern", "alpha_pattern"):
        value = raw.get(field) or {}
        if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  for v in value.values()):
            raise LoraError(f"LoRA adapter {name!r}: {field}={value!r} must map module names to numbers")
        patterns[field] = tuple(value.items())
    return PeftLoraConfig(r, float(alpha), bool(raw.get("use_rslora", False)), patterns["rank_pattern"],
                          patterns["alpha_pattern"])
