"""tokenization.model_store: what ``--model`` resolves to and the public model name, offline (no
download: the default model's conversion is not exercised here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenization.model_store import DEFAULT_MODEL, ModelError, model_name, resolve_model


def test_a_local_folder_resolves_to_itself_and_is_named_after_it(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(folder) == folder.resolve()
    assert resolve_model(str(folder)) == folder.resolve()
    assert model_name(folder) == "my-model"


def test_bad_paths_are_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ModelError, match="is a file"):
        resolve_model(f)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(empty)
    for missing in (str(tmp_path / "nope"), "./nope", "~/nope-lockgate", "a/b/c"):
        with pytest.raises(ModelError, match="does not exist"):
            resolve_model(missing)


def test_hub_ids_pass_through_and_the_default_has_one_name() -> None:
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for spec in (None, "", "default", DEFAULT_MODEL):
        assert model_name(spec) == DEFAULT_MODEL
