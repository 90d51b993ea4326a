"""Shared fixtures for every package's tests. Keep each fixture small and documented.

``kafka_bootstrap`` (session): the address of a real Apache Kafka broker for tests marked
``@pytest.mark.kafka``. It uses ``LOCKGATE_TEST_KAFKA`` (``host:port``, exported by ``make test``)
when set, else starts the local broker itself (``lockgate kafka start``, jars cached under
``~/.cache/lockgate/kafka``). When no broker can be had the test fails, never skips. At the end of
the session it deletes the topics the session created with a test's name (``TEST_TOPIC``: every
test names its topics ``t`` + ``.``, ``-`` or a hex digit, from a uuid), so a long-lived local
broker does not collect thousands of test topics. Only those: the broker may be shared with a
platform or a benchmark that made topics meanwhile (a teardown that deleted every new topic once
took a concurrent ``lockgate bench e2e`` run's topics away mid-run).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from dataclasses import dataclass

import pytest

TEST_TOPIC = re.compile(r"t[.\-0-9a-f]")


def _pin_float32_default_on_amx_hosts() -> None:
    """On a CPU with AMX, ``--dtype auto`` (every test's EngineConfig default) runs bf16 linears on
    AMX tiles, whose outputs differ from float32 in the third digit; the suite's parity tests (HF
    float32, exact references) are written for the float32 default. So the suite runs at the
    ``avx512`` level unless LOCKGATE_CPU_ISA says otherwise, and the amx level is tested where a
    test asks for it: the ``isa`` fixture (tests/engine_workers/conftest.py) and
    tests/engine_workers/kernels/test_amx_linear.py switch to it in process."""
    from engine_workers.kernels.isa import ISA_ENV, host_isa

    if host_isa() == "amx" and not os.environ.get(ISA_ENV):
        os.environ[ISA_ENV] = "avx512"


_pin_float32_default_on_amx_hosts()


async def _with_bus(addr: str, use):
    from bus import connect

    async with connect(f"kafka://{addr}?client_id=lockgate-tests") as bus:
        return await use(bus)


def _topics(addr: str) -> set[str]:
    return set(asyncio.run(_with_bus(addr, lambda bus: bus.list_topics())))


def _delete_topics(addr: str, names: list[str]) -> None:
    async def delete(bus) -> None:
        for i in range(0, len(names), 100):
            await bus.delete_topics(names[i:i + 100])

    asyncio.run(_with_bus(addr, delete))


@pytest.fixture(scope="session")
def kafka_bootstrap():
    addr = _broker_address()
    before = _topics(addr)
    yield addr
    try:  # best effort: a broker that went away must not turn passed tests into errors
        created = sorted(t for t in _topics(addr) - before if TEST_TOPIC.match(t))
        if created:
            _delete_topics(addr, created)
    except Exception as exc:
        print(f"\nkafka_bootstrap: could not delete this session's topics: {exc!r}", file=sys.stderr)


@dataclass(frozen=True, slots=True)
class PrivateBroker:
    """A broker of one test's own (``private_kafka``): stopping it touches no other test."""

    bootstrap: str
    port: int

    async def stop(self) -> None:
        """A clean stop (SIGTERM: the broker shuts down as in a restart or rolling upgrade)."""
        from devtools import kafka_local

        await asyncio.to_thread(kafka_local.stop, 1, self.port, kafka_local.DEFAULT_DIR)

    async def start(self) -> None:
        from devtools import kafka_local

        await asyncio.to_thread(kafka_local.start, 1, self.port, kafka_local.DEFAULT_DIR)


# its controller on +100; the session broker's 9092/9192 stay apart. An env twin lets two
# checkouts run fault tests side by side on one machine.
PRIVATE_KAFKA_PORT = int(os.environ.get("LOCKGATE_TEST_PRIVATE_KAFKA_PORT", "19392"))


@pytest.fixture
def private_kafka(kafka_bootstrap):  # after the session broker (its jars fetched)
    """A fresh single-node broker for fault tests, on ``PRIVATE_KAFKA_PORT`` (data under the jar
    cache, removed afterwards). ~5 s to start on the 2-core box."""
    import shutil

    from devtools import kafka_local

    info = kafka_local.start(1, PRIVATE_KAFKA_PORT, kafka_local.DEFAULT_DIR, fresh=True)
    try:
        yield PrivateBroker(info.bootstrap, PRIVATE_KAFKA_PORT)
    finally:
        kafka_local.stop(1, PRIVATE_KAFKA_PORT, kafka_local.DEFAULT_DIR)
        shutil.rmtree(info.directory, ignore_errors=True)


def _broker_address() -> str:
    addr = os.environ.get("LOCKGATE_TEST_KAFKA", "").strip()
    if addr:
        return addr
    from devtools import kafka_local

    port = int(os.environ.get("LOCKGATE_TEST_KAFKA_PORT", "9092"))
    try:
        info = kafka_local.start(nodes=1, port=port)
    except Exception as exc:  # any failure to get a broker fails the Kafka tests
        where = "in CI " if os.environ.get("CI") else ""
        pytest.fail(f"Kafka tests need a broker {where}and none could be started: {exc}", pytrace=False)
    return info.bootstrap


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint (2 layers, 512-token BPE vocab, chat template), written once
    per session with ``save_pretrained`` and loaded through the real loading code."""
    from devtools.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The default SmolLM2-135M-Instruct checkpoint (converted from GGUF once, cached)."""
    from tokenization.model_store import ensure_default_model

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


@pytest.fixture
def run_until_signalled(tmp_path):
    """``run(args, ready_text, sig)``: start ``python -m lockgate.cli *args`` (the ``lockgate``
    command), wait (<= 120 s) for ``ready_text`` on its stdout, send ``sig``, and return its exit
    code (<= 60 s) and its stderr. The process is killed if anything fails on the way."""
    import signal as signals
    import subprocess
    import time

    def run(args: list[str], ready_text: str, sig: int = signals.SIGTERM) -> tuple[int, str]:
        err = tmp_path / "stderr.txt"
        env = dict(os.environ, LOCKGATE_LOG_LEVEL="WARNING")
        with open(err, "wb") as ferr:
            proc = subprocess.Popen([sys.executable, "-m", "lockgate.cli", *args], stdout=subprocess.PIPE,
                                    stderr=ferr, env=env)
            try:
                deadline = time.monotonic() + 120
                line = b""
                while ready_text.encode() not in line:
                    assert time.monotonic() < deadline and proc.poll() is None, err.read_text()
                    line = proc.stdout.readline()
                proc.send_signal(sig)
                rc = proc.wait(60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
        return rc, err.read_text()

    return run


THREE_NODE_PORT = 19700  # its controllers on +100..+102: apart from the session broker (9092, 9192) and private_kafka (19392, 19492)


@pytest.fixture(scope="module")
def three_brokers(kafka_bootstrap: str):  # after the session broker (its jars fetched)
    """A fresh 3-node cluster for one test module's leader-failover tests (data removed afterwards);
    ~20-60 s to start on 2 cores. Module-scoped, not session-scoped: three idle JVMs left running
    for the rest of the session take CPU from the timing-sensitive tests that follow on 2 cores. A
    test that stops a node brings it back before it ends."""
    import shutil

    from devtools import kafka_local

    info = kafka_local.start(3, THREE_NODE_PORT, kafka_local.DEFAULT_DIR, fresh=True, timeout_s=180)
    try:
        yield info
    finally:
        kafka_local.stop(3, THREE_NODE_PORT, kafka_local.DEFAULT_DIR)
        shutil.rmtree(info.directory, ignore_errors=True)
