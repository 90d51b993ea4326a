"""Shared fixtures for every package's tests. Keep each fixture small and documented.

``kafka_bootstrap`` (session): the address of a real Apache Kafka broker for tests marked
``@pytest.mark.kafka``. It uses ``LOCKGATE_TEST_KAFKA`` (``host:port``, exported by ``make test``)
when set, else starts the local broker itself (``lockgate kafka start``, jars cached under
``~/.cache/lockgate/kafka``). When no broker can be had the test fails, never skips.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    addr = os.environ.get("LOCKGATE_TEST_KAFKA", "").strip()
    if addr:
        return addr
    from bus import kafka_local

    port = int(os.environ.get("LOCKGATE_TEST_KAFKA_PORT", "9092"))
    try:
        info = kafka_local.start(nodes=1, port=port)
    except Exception as exc:  # noqa: BLE001 - any failure to get a broker fails the Kafka tests
        where = "in CI " if os.environ.get("CI") else ""
        pytest.fail(f"Kafka tests need a broker {where}and none could be started: {exc}", pytrace=False)
    return info.bootstrap


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint (2 layers, 512-token BPE vocab, chat template), written once
    per session with ``save_pretrained`` and loaded through the real loading code."""
    from engine_workers.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The default SmolLM2-135M-Instruct checkpoint (converted from GGUF once, cached)."""
    from engine_workers.model_store import ensure_default_model

    return str(ensure_default_model())


def pytest_collection_modifyitems(config, items) -> None:
    """``gpu`` tests run where CUDA exists and are skipped (with the reason) elsewhere."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in gpu_items:
        item.add_marker(skip)
