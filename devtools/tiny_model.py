"""A tiny randomly initialised Llama checkpoint, for tests and quick demos.

It is a real HF folder (``save_pretrained``: config.json, safetensors, tokenizer files with a chat
template) so it goes through exactly the loading code a real checkpoint does. The tokenizer is a
byte-level BPE trained in-process on a small built-in corpus, so any text (unicode included)
tokenizes; its vocabulary is small (~512) to keep the model tiny.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Serving large language models needs paged attention, continuous batching and a priority queue.",
    "Kafka topics are partitioned, durable and replayable; consumers commit offsets.",
    "Bonjour, ça va? Grüße aus München! こんにちは世界 你好 🙂 émoji naïve café",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i)",
    "Once upon a time there was a little model that generated one token at a time.",
    "0123456789 +-*/=<>()[]{}.,;:!?'\"",
]


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    initializer_range: float = 0.2,
    rope_parameters: dict | None = None,
) -> Path:
    """Write a tiny random Llama + tokenizer to ``out`` and return the path.

    ``initializer_range`` is large on purpose: with the usual 0.02 the logits of a random model are
    nearly uniform and greedy argmax ties would make token-exact comparisons fragile.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()  # type: ignore[arg-type]  # PreTrainedModel.to is functools.wraps'd; typeshed's _Wrapped does not bind self
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "lockgate-tiny.json").write_text(json.dumps({"seed": seed}))
    return out
