"""Bus URLs: the bootstrap list of a kafka:// URL, and the errors that name what is wrong."""

from __future__ import annotations

import pytest

from bus import connect, kafka_bootstrap


def test_kafka_bootstrap_lists_every_address_in_order() -> None:
    assert kafka_bootstrap("kafka://127.0.0.1:9092, localhost:9093?linger_ms=1") == [("127.0.0.1", 9092),
                                                                                    ("localhost", 9093)]


@pytest.mark.parametrize(("url", "message"), [
    ("kafka://", "no bootstrap address"),
    ("kafka://broker", "'broker' is not host:port"),
    ("kafka://broker:x", "'broker:x' is not host:port"),
    ("kafka://:9092", "':9092' is not host:port"),
])
def test_bad_bootstrap_is_refused_naming_it(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kafka_bootstrap(url)
    with pytest.raises(ValueError, match=message):
        connect(url)
