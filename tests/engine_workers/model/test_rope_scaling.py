"""lockgate's RoPE rotations against transformers' own rotary embedding modules, for every
rope_type the supported families use: the fixed types position by position, and longrope /
dynamic per sequence (a sequence's context selects its frequencies, as transformers' forward does
for a fresh model, batch of one)."""

from __future__ import annotations

import pytest
import torch

from engine_workers.model.models.rope import build_rope

HEAD = 16
SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=HEAD, max_position_embeddings=64)
LONG_FACTOR = [1.0 + 0.5 * j for j in range(HEAD // 2)]
SHORT_FACTOR = [1.0 + 0.05 * j for j in range(HEAD // 2)]
CASES = {
    "default": ("llama", {"rope_type": "default", "rope_theta": 10000.0}),
    "linear": ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "dynamic": ("llama", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "yarn": ("qwen2", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 16}),
    "llama3": ("llama", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "longrope": ("phi3", {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": LONG_FACTOR,
                          "short_factor": SHORT_FACTOR, "original_max_position_embeddings": 32}),
}


def hf_rotary(name: str):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    model_type, params = CASES[name]
    extra = {"max_position_embeddings": 128, "original_max_position_embeddings": 32} if model_type == "phi3" else {}
    cfg = AutoConfig.for_model(model_type, **{**SMALL, **extra}, rope_parameters=params)
    cls = {"llama": LlamaRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding, "phi3": Phi3RotaryEmbedding}[model_type]
    return cfg, cls(cfg)


def hf_cos_sin(rotary, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[length, HEAD/2]`` of a fresh module's forward over positions 0..length-1."""
    x = torch.zeros(1, length, HEAD)
    cos, sin = rotary(x, torch.arange(length)[None])
    return cos[0, :, : HEAD // 2], sin[0, :, : HEAD // 2]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("length", [20, 100])  # within and beyond the original / trained context
def test_rotations_match_transformers(name, length):
    cfg, rotary = hf_rotary(name)
    cos, sin = hf_cos_sin(rotary, length)
    rope = build_rope(cfg, HEAD, 256, torch.device("cpu"))
    positions = torch.arange(length)
    # one sequence of ``length`` tokens prefilled at once: every token's context is ``length``
    rot = rope.rotations(positions, torch.full((length,), length))[:, 0]
    torch.testing.assert_close(rot.real, cos, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(rot.imag, sin, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["longrope", "dynamic"])
def test_context_selects_frequencies_per_sequence(name):
    """Two sequences in one step, one within the original context and one beyond it: each gets
    the rotation transformers gives it alone."""
    cfg, _ = hf_rotary(name)
    rope = build_rope(cfg, HEAD, 256, torch.device("cpu"))
    assert rope.needs_ends
    short, long = 20, 100
    positions = torch.cat([torch.arange(short), torch.arange(long)])
    ends = torch.cat([torch.full((short,), short), torch.full((long,), long)])
    rot = rope.rotations(positions, ends)[:, 0]
    for rows, length in ((slice(0, short), short), (slice(short, None), long)):
        cos, sin = hf_cos_sin(hf_rotary(name)[1], length)
        torch.testing.assert_close(rot[rows].real, cos, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(rot[rows].imag, sin, atol=2e-5, rtol=1e-5)
    # and beyond the switch the rotation really differs from the fixed table
    assert not torch.allclose(rot[short:].real, rope.base[:long].real)
