"""SASL against a real broker: a private single-node Kafka (the jars of devtools/kafka_local.py)
with one SASL_PLAINTEXT listener taking PLAIN and SCRAM-SHA-256, started by this module on free
loopback ports and stopped after it. Every client the bus creates (producer, admin, group
consumer, group-less partition reader) must authenticate, or the broker refuses it.

Cost: one broker start (~10-20 s on 2 cores) for the module. TLS is not exercised here (no broker
certificate): the TLS context's construction is tested in test_kafka_security.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus import BusError, TopicSpec, connect
from devtools import kafka_local

pytestmark = pytest.mark.kafka

USER, PASSWORD = "lockgate", "s3cret-pw"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _properties(port: int, controller: int, data: Path) -> str:
    plain = ('org.apache.kafka.common.security.plain.PlainLoginModule required username="broker" '
             f'password="broker-pw" user_broker="broker-pw" user_{USER}="{PASSWORD}";')
    return f"""process.roles=broker,controller
node.id=0
controller.quorum.voters=0@127.0.0.1:{controller}
listeners=SASL_PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}
advertised.listeners=SASL_PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=SASL_PLAINTEXT
listener.security.protocol.map=SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256
sasl.mechanism.inter.broker.protocol=PLAIN
listener.name.sasl_plaintext.plain.sasl.jaas.config={plain}
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
log.dirs={data}
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=2
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
num.network.threads=1
num.io.threads=2
"""


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``127.0.0.1:<port>`` of a private SASL broker; its process is owned and stopped here."""
    try:
        libs = kafka_local.fetch_jars()
    except kafka_local.KafkaLocalError as exc:
        pytest.skip(f"Kafka jars unavailable: {exc}")
    d = tmp_path_factory.mktemp("sasl-kafka")
    (d / "logs").mkdir()
    port, controller = free_port(), free_port()
    props = d / "server.properties"
    props.write_text(_properties(port, controller, d / "data"))
    (d / "log4j2.properties").write_text(kafka_local._log4j2_properties(d))
    java = kafka_local._java(libs, d)
    fmt = subprocess.run([*java, "kafka.tools.StorageTool", "format", f"--cluster-id={kafka_local._kafka_uuid()}",
                          "-c", str(props), "--add-scram", f"SCRAM-SHA-256=[name={USER},password={PASSWORD}]"],
                         capture_output=True, text=True, timeout=180)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    with open(d / "stdout.log", "wb") as out:
        proc = subprocess.Popen([*java, "kafka.Kafka", str(props)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # the listener accepting connections; authentication is the tests' business
            assert proc.poll() is None, f"broker exited:\n{kafka_local._log_tail(d)}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"broker not listening after 120 s:\n{kafka_local._log_tail(d)}"
                time.sleep(0.25)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def _round_trip(url: str, **kw: str) -> None:
    """Create a topic, send, read it back through a group consumer and the partition reader."""
    topic = f"sasl-{uuid.uuid4().hex[:8]}"
    async with connect(url, **kw) as bus:
        await bus.ensure_topics([TopicSpec(topic, 1, 1)])  # admin client
        md = await bus.send(topic, b"hello", key=b"k")  # producer
        got: list[bytes] = []
        async with bus.consumer([topic], group_id=f"g-{topic}", start_from="earliest") as c:  # group consumer
            deadline = time.monotonic() + 60
            while not got and time.monotonic() < deadline:
                got += [r.value for r in await c.getmany(timeout_ms=500)]
        assert got == [b"hello"]
        records = await bus.read_partition(topic, md.partition, since_ms=0)  # group-less reader
        assert [r.value for r in records] == [b"hello"]


async def test_plain_authenticates_every_client(sasl_broker: str) -> None:
    await asyncio.wait_for(_round_trip(f"kafka://{sasl_broker}?connect_timeout_s=60&security_protocol=SASL_PLAINTEXT"
                                       f"&sasl_mechanism=PLAIN&sasl_username={USER}", sasl_password=PASSWORD), 150)


async def test_scram_sha_256_from_the_environment(sasl_broker: str, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    pw = tmp_path / "password"
    pw.write_text(PASSWORD + "\n")
    for k, v in {"SECURITY_PROTOCOL": "SASL_PLAINTEXT", "SASL_MECHANISM": "SCRAM-SHA-256",
                 "SASL_USERNAME": USER, "SASL_PASSWORD_FILE": str(pw)}.items():
        monkeypatch.setenv(f"LOCKGATE_KAFKA_{k}", v)
    assert "LOCKGATE_KAFKA_SASL_PASSWORD" not in os.environ
    await asyncio.wait_for(_round_trip(f"kafka://{sasl_broker}?connect_timeout_s=60"), 150)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
async def test_wrong_password_is_refused(sasl_broker: str, mechanism: str) -> None:
    bus = connect(f"kafka://{sasl_broker}?connect_timeout_s=3&security_protocol=SASL_PLAINTEXT"
                  f"&sasl_mechanism={mechanism}&sasl_username={USER}", sasl_password="wrong")
    with pytest.raises(BusError, match=sasl_broker) as err:
        await asyncio.wait_for(bus.start(), 30)
    assert "Authentication" in str(err.value), err.value  # refused by the broker, not unreachable
    await bus.stop()


async def test_plaintext_client_gets_nothing_from_a_sasl_listener(sasl_broker: str) -> None:
    """The broker really demands SASL: a client without it does not get through."""
    bus = connect(f"kafka://{sasl_broker}?connect_timeout_s=3")
    with pytest.raises(BusError, match=sasl_broker):
        await asyncio.wait_for(bus.start(), 30)
    await bus.stop()
