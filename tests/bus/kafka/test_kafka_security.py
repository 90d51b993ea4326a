"""Kafka TLS/SASL settings (bus/kafka/security.py): URL, keywords and environment become aiokafka's
own client options, for every client the bus creates; bad settings are refused naming the option."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from bus import connect
from bus.kafka.security import KafkaSecurity, security_from

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed CA certificate made for this test (openssl CLI; no network)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("ca")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=lockgate-test-ca", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt")],
                   check=True, capture_output=True, timeout=60)
    return d / "ca.crt"


def test_plaintext_default_passes_no_options() -> None:
    sec = security_from({}, {})
    assert sec == KafkaSecurity()
    assert sec.client_kwargs() == {}
    bus = connect("kafka://127.0.0.1:9")
    assert bus.client_kwargs == {}  # type: ignore[attr-defined]


def test_sasl_plaintext_scram_from_url_and_env_password() -> None:
    env = {"LOCKGATE_KAFKA_SASL_PASSWORD": "s3cret"}
    sec = security_from({"security_protocol": "sasl_plaintext", "sasl_mechanism": "scram-sha-256",
                         "sasl_username": "lockgate"}, env)
    assert sec.client_kwargs() == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
                                   "sasl_plain_username": "lockgate", "sasl_plain_password": "s3cret"}
    assert "s3cret" not in repr(sec) and "s3cret" not in sec.describe()


@needs_openssl
def test_sasl_ssl_from_environment_builds_context_from_ca(ca_file: Path, tmp_path: Path) -> None:
    pw = tmp_path / "password"
    pw.write_text("from-a-file\n")
    env = {"LOCKGATE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "LOCKGATE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
           "LOCKGATE_KAFKA_SASL_USERNAME": "svc", "LOCKGATE_KAFKA_SASL_PASSWORD_FILE": str(pw),
           "LOCKGATE_KAFKA_SSL_CAFILE": str(ca_file)}
    kw = security_from({}, env).client_kwargs()
    assert kw["security_protocol"] == "SASL_SSL" and kw["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kw["sasl_plain_username"] == "svc" and kw["sasl_plain_password"] == "from-a-file"
    ctx = kw["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    subjects = [dict(x[0] for x in c["subject"]) for c in ctx.get_ca_certs()]
    assert {"commonName": "lockgate-test-ca"} in subjects, subjects


@needs_openssl
async def test_options_reach_every_aiokafka_client(ca_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bus's kwargs are accepted by aiokafka's producer, consumer and admin client and land in
    each one's connection settings (a misspelt option would be a TypeError here)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient

    monkeypatch.setenv("LOCKGATE_KAFKA_SASL_PASSWORD", "pw")
    bus = connect(f"kafka://127.0.0.1:9?security_protocol=SASL_SSL&sasl_mechanism=PLAIN&sasl_username=u"
                  f"&ssl_cafile={ca_file}&ssl_check_hostname=false")
    kw = bus.client_kwargs  # type: ignore[attr-defined]
    assert kw["ssl_context"].check_hostname is False
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:9", **kw)
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9", **kw)
    admin = AIOKafkaAdminClient(bootstrap_servers="127.0.0.1:9", **kw)
    for c in (producer.client, consumer._client, admin._client):
        assert (c._security_protocol, c._sasl_mechanism, c._sasl_plain_username, c._sasl_plain_password) == \
            ("SASL_SSL", "PLAIN", "u", "pw")
        assert c._ssl_context is kw["ssl_context"]
    await producer.stop()
    await consumer.stop()
    await admin.close()


def test_bad_mechanism_is_refused_naming_it() -> None:
    env = {"LOCKGATE_KAFKA_SASL_PASSWORD": "x"}
    with pytest.raises(ValueError, match="sasl_mechanism 'GSSAPI' is not supported"):
        security_from({"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "sasl_username": "u"}, env)
    with pytest.raises(ValueError, match="SCRAM-SHA-1"):
        connect("kafka://127.0.0.1:9?security_protocol=SASL_PLAINTEXT&sasl_mechanism=SCRAM-SHA-1&sasl_username=u",
                sasl_password="x")
    with pytest.raises(ValueError, match="security_protocol 'TLS' is not supported"):
        security_from({"security_protocol": "TLS"}, {})


def test_inconsistent_or_unsafe_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sasl_password is not accepted in the bus URL"):
        connect("kafka://127.0.0.1:9?security_protocol=SASL_SSL&sasl_username=u&sasl_password=oops")
    with pytest.raises(ValueError, match="needs a password: set LOCKGATE_KAFKA_SASL_PASSWORD"):
        security_from({"security_protocol": "SASL_SSL", "sasl_username": "u"}, {})
    with pytest.raises(ValueError, match="needs sasl_username"):
        security_from({"security_protocol": "SASL_PLAINTEXT"}, {"LOCKGATE_KAFKA_SASL_PASSWORD": "x"})
    with pytest.raises(ValueError, match="sasl_mechanism needs a SASL security_protocol"):
        security_from({"sasl_mechanism": "PLAIN"}, {})
    with pytest.raises(ValueError, match="ssl_cafile needs a TLS security_protocol"):
        security_from({"ssl_cafile": str(tmp_path)}, {})
    with pytest.raises(ValueError, match=f"ssl_cafile: no readable file at '{tmp_path / 'nope.crt'}'"):
        security_from({"security_protocol": "SSL", "ssl_cafile": str(tmp_path / "nope.crt")}, {})
    with pytest.raises(ValueError, match="sasl_password_file: cannot read"):
        security_from({"security_protocol": "SASL_SSL", "sasl_username": "u",
                       "sasl_password_file": str(tmp_path / "missing")}, {})
    with pytest.raises(ValueError, match="ssl_check_hostname='maybe' is not a boolean"):
        security_from({"security_protocol": "SSL", "ssl_check_hostname": "maybe"}, {})
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="TLS files could not be loaded"):
        connect(f"kafka://127.0.0.1:9?security_protocol=SSL&ssl_cafile={garbage}")



def test_ssl_check_hostname_is_refused_without_tls() -> None:
    with pytest.raises(ValueError, match="ssl_check_hostname needs a TLS security_protocol"):
        security_from({"ssl_check_hostname": "false"}, {})
    assert security_from({"security_protocol": "SSL", "ssl_check_hostname": "false"}, {}).ssl_check_hostname is False
