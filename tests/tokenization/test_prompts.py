"""tokenization.prompts.PromptTokenizer on the tiny BPE tokenizer (devtools/tiny_model.py):
the context length it reads (config.json, else the tokenizer's own), chat messages through the chat template, raw prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus import ChatMessage
from devtools.tiny_model import build_tokenizer
from tokenization.prompts import PromptTokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(out)
    return out


def test_context_length_comes_from_config_then_the_tokenizer(tok_dir: Path, tmp_path: Path) -> None:
    (tok_dir / "config.json").write_text('{"max_position_embeddings": 777}')
    assert PromptTokenizer.from_path(tok_dir).context_len == 777
    (tok_dir / "config.json").unlink()
    limited = tmp_path / "limited"
    build_tokenizer().save_pretrained(limited)
    (limited / "config.json").write_text('{"max_position_embeddings": 0}')  # 0 = not stated
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(limited))
    t.model_max_length = 300
    t.save_pretrained(limited)
    assert PromptTokenizer.from_path(limited).context_len == 300


def test_chat_ids_are_the_template_then_the_generation_prompt(tok_dir: Path) -> None:
    pt = PromptTokenizer.from_path(tok_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Kafka topics are partitioned"}]
    ids = pt.chat_ids(msgs)
    text = pt.tokenizer.decode(ids)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nKafka topics are partitioned<|im_end|>\n"
                    "<|im_start|>assistant\n")
    im_start = pt.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3  # special tokens from the template, none added
    # ChatMessage objects (the wire type) and dicts give the same ids
    assert pt.chat_ids([ChatMessage(role=m["role"], content=m["content"]) for m in msgs]) == ids


def test_text_ids_round_trip_and_differ_from_chat(tok_dir: Path) -> None:
    pt = PromptTokenizer.from_path(tok_dir)
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = pt.text_ids(prompt)
    assert ids and pt.tokenizer.decode(ids) == prompt
    assert len(ids) < len(prompt)  # BPE merges: fewer ids than characters
    assert pt.text_ids(prompt) == ids  # deterministic
    assert pt.chat_ids([{"role": "user", "content": prompt}]) != ids
    assert pt.text_ids("") == []
