"""The key file's ``weight`` (fair share within a tier at the workers)."""

import pytest

from edge.config import ConfigError, KeyEntry, parse_keys

H = "a" * 64


def test_weight_is_read_defaulted_and_written() -> None:
    keys = parse_keys(f'{{"sha256": "{H}", "tenant": "acme", "weight": 2}}\n{{"sha256": "{"b" * 64}", "tenant": "b"}}')
    assert keys[H].weight == 2.0 and keys["b" * 64].weight == 1.0
    assert parse_keys(keys[H].to_json())[H] == keys[H]


@pytest.mark.parametrize("bad", [0, -1, 5000, "2", True, None])
def test_a_bad_weight_names_the_line(bad: object) -> None:
    import json

    with pytest.raises(ConfigError, match="k:1: weight"):
        parse_keys(json.dumps({"sha256": H, "tenant": "t", "weight": bad}), "k")
    with pytest.raises(ConfigError):
        KeyEntry(H, "t", weight=bad)  # type: ignore[arg-type]
