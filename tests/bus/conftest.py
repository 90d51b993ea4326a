"""Fixtures for the bus conformance suite: every test runs on the memory bus and on real Kafka."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from bus import Bus, connect


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    return f"kafka://{bootstrap}?client_id=lockgate-tests"


@pytest.fixture
async def bus(bus_url: str) -> AsyncIterator[Bus]:
    async with connect(bus_url) as b:
        yield b


@pytest.fixture
def name() -> str:
    """A unique topic/group name prefix, so tests never see each other's records."""
    return f"t.{uuid.uuid4().hex[:12]}"
