"""A config field lockgate does not implement is refused at load, by name, before any weight is
read: the model would otherwise load and compute something else."""

from __future__ import annotations

import json

import pytest
import torch

from engine_workers.model.loading.loader import load_model
from engine_workers.model.models.spec import ModelSpec
from tokenization.model_store import ModelError

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)


def folder(tmp_path, model_type: str, **fields):
    """A model folder holding only a config.json (the refusal comes before tokenizer and weights)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **BASE).to_dict()
    cfg.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(("model_type", "fields", "named"), [
    ("llama", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ("mistral", {"some_future_flag": True}, "some_future_flag"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("qwen2", {"layer_types": ["sliding_attention", "chunked_attention"], "sliding_window": 8,
                "use_sliding_window": True}, "layer_types[1]"),
    ("llama", {"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope_type"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("olmo2", {"sliding_window": 16}, "sliding_window"),  # OLMo 2 has no window: a field it never reads
])
def test_unimplemented_field_refused_by_name(tmp_path, model_type, fields, named):
    path = folder(tmp_path, model_type, **fields)
    with pytest.raises(ModelError, match=named.replace("[", r"\[").replace("]", r"\]")):
        load_model(str(path), torch.float32, torch.device("cpu"))


def test_unsupported_family_refused(tmp_path):
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        load_model(str(folder(tmp_path, "gpt2")), torch.float32, torch.device("cpu"))


def test_every_field_of_each_family_default_config_is_read_or_inert():
    """Each supported family's own default config passes the field check (a transformers upgrade
    adding a field fails here, naming it, rather than in a user's load)."""
    from transformers import AutoConfig

    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "phi3"):
        spec = ModelSpec.from_hf(AutoConfig.for_model(model_type, **BASE))
        assert spec.model_type == model_type and len(spec.layer_windows) == BASE["num_hidden_layers"]
