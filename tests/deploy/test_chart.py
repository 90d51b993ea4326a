"""The Helm chart (deploy/helm/lockgate) against the code it deploys: the names KEDA scales on are
the ones the workers really use, and every env var and argument the pods get is one the CLI reads.

Renders with the helm that ``make deploy-check`` installs (scripts/deploy/tools.sh); skipped with
the reason when it is not installed. Cost: ~1 s per render.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bus import TopicLayout
from bus.kafka.security import ENV_PREFIX, SECRET_OPTIONS, URL_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "lockgate"
EXAMPLE = CHART / "ci" / "example-values.yaml"
TOOLS = Path(os.environ.get("LOCKGATE_TOOLS", Path.home() / ".cache" / "lockgate" / "tools"))
HELM = shutil.which("helm", path=str(TOOLS / "bin")) or shutil.which("helm")

pytestmark = pytest.mark.skipif(HELM is None, reason="helm not installed: run `make deploy-check` (installs it)")


def render(tmp_path: Path, values: dict[str, Any] | None = None, files: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    args = [str(HELM), "template", "lg", str(CHART), "--kube-version", "1.33.0"]
    for f in files:
        args += ["-f", str(f)]
    if values is not None:
        extra = tmp_path / "values.yaml"
        extra.write_text(yaml.safe_dump(values))
        args += ["-f", str(extra)]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{len(found)} {kind} *{suffix} rendered"
    return found[0]


def container_env(docs: list[dict[str, Any]], kind: str, suffix: str) -> tuple[dict[str, str], list[str]]:
    """The env a container sees (its ConfigMap, then its own env; $(POD_NAME) resolved) and its args."""
    workload = one(docs, kind, suffix)
    c = workload["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for ref in c.get("envFrom", []):
        env.update(one(docs, "ConfigMap", ref["configMapRef"]["name"])["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"]).replace("$(POD_NAME)", "lg-pod-0")
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = "lg-pod-0"
        else:
            env[e["name"]] = "from-a-secret"
    return env, [str(a) for a in c.get("args", [])]


def parse_as_pod(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str]) -> Any:
    """Parse ``argv`` with lockgate's own parser under exactly ``env``'s LOCKGATE_* variables."""
    for k in list(os.environ):
        if k.startswith("LOCKGATE_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from lockgate.cli import build_parser

    return build_parser().parse_args(argv)


def check_flags_exist(args: Any, env: dict[str, str], argv: list[str]) -> None:
    """Every LOCKGATE_<NAME> the pod gets is the env twin of a flag it parsed (its value taken
    unless the flag is also given in ``argv``), or a global / Kafka security setting lockgate reads."""
    for key, value in env.items():
        if not key.startswith("LOCKGATE_") or key in ("LOCKGATE_LOG_LEVEL", "LOCKGATE_LOG_FORMAT"):
            continue
        if key.startswith(ENV_PREFIX):
            assert key[len(ENV_PREFIX):].lower() in {*URL_OPTIONS, *SECRET_OPTIONS}, f"{key}: lockgate reads no such Kafka option"
            continue
        dest = key[len("LOCKGATE_"):].lower()
        assert hasattr(args, dest), f"{key}: `lockgate {args.command}` has no flag --{dest.replace('_', '-')}"
        if f"--{dest.replace('_', '-')}" in argv:
            continue  # an explicit argument wins over its env twin
        got = getattr(args, dest)
        assert str(got).lower() == value.lower() or got == type(got)(value), f"{key}={value!r} parsed as {got!r}"


@pytest.mark.parametrize("model", ["HuggingFaceTB/SmolLM2-360M-Instruct", "org/My Model:v2@main", "..odd--name..",
                                   "x/" + "m" * 130])
def test_keda_scales_on_the_workers_own_group_and_topics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         model: str) -> None:
    docs = render(tmp_path, {"model": {"name": model}})
    env, args = container_env(docs, "Deployment", "-worker")
    from lockgate.commands.worker import worker_config_from_args

    cfg = worker_config_from_args(parse_as_pod(monkeypatch, env, args))
    triggers = one(docs, "ScaledObject")["spec"]["triggers"]
    assert {t["metadata"]["consumerGroup"] for t in triggers} == {cfg.group}
    assert [t["metadata"]["topic"] for t in triggers] == cfg.layout.request_topics(cfg.model)
    assert cfg.layout == TopicLayout(partitions=6)  # LOCKGATE_PARTITIONS from topics.partitions


def test_strimzi_topics_are_the_layout(tmp_path: Path) -> None:
    docs = render(tmp_path, files=(EXAMPLE,))
    topics = {d["spec"]["topicName"]: d["spec"] for d in docs if d["kind"] == "KafkaTopic"}
    specs = TopicLayout(partitions=12, replication=3).model_specs("qwen2.5-7b")
    assert set(topics) == {s.name for s in specs}
    for s in specs:
        assert (topics[s.name]["partitions"], topics[s.name]["replicas"]) == (s.partitions, s.replication), s.name
    assert not [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].endswith("-topics")], \
        "Strimzi owns the topics: no topics hook Job"
    so = one(docs, "ScaledObject")
    assert so["spec"]["maxReplicaCount"] == 12 and so["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"


@pytest.mark.parametrize("values", ["default", "example"])
def test_every_pod_env_and_arg_is_a_real_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, values: str) -> None:
    docs = render(tmp_path, files=(EXAMPLE,) if values == "example" else ())
    pods = [("Deployment", "-edge"), ("StatefulSet" if values == "example" else "Deployment", "-worker")]
    if values == "example":
        pods.append(("Job", "-batch-nightly-eval"))
    else:
        pods.append(("Job", "-topics"))
    for kind, suffix in pods:
        env, args = container_env(docs, kind, suffix)
        parsed = parse_as_pod(monkeypatch, env, args)  # argparse exits on an unknown flag
        check_flags_exist(parsed, env, args)
    edge_env, _ = container_env(docs, "Deployment", "-edge")
    edge = parse_as_pod(monkeypatch, edge_env, ["edge"])
    svc = one(docs, "Service", "-edge")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"ws": edge.port, "openai": edge.openai_port}
    assert edge.host == "0.0.0.0"
    probes = one(docs, "Deployment", "-edge")["spec"]["template"]["spec"]["containers"][0]
    assert probes["livenessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
    assert probes["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}


def test_sasl_settings_reach_the_bus_and_never_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(tmp_path, files=(EXAMPLE,))
    env, args = container_env(docs, "StatefulSet", "-worker")
    assert not [a for a in args if "password" in a.lower()]
    assert "LOCKGATE_KAFKA_SASL_PASSWORD" not in env, "the password is a mounted file, not an env value"
    pw = tmp_path / "password"
    pw.write_text("pw\n")
    ca = tmp_path / "ca.crt"
    ca.write_text("")
    env = {**env, "LOCKGATE_KAFKA_SASL_PASSWORD_FILE": str(pw), "LOCKGATE_KAFKA_SSL_CAFILE": str(ca)}
    args_ns = parse_as_pod(monkeypatch, env, args)
    from bus.kafka.security import security_from

    sec = security_from({}, os.environ)
    assert (sec.security_protocol, sec.sasl_mechanism, sec.sasl_username, sec.sasl_password) == \
        ("SASL_SSL", "SCRAM-SHA-512", "from-a-secret", "pw")
    assert args_ns.bus.startswith("kafka://b-1.kafka.internal:9096,")
    secret_vols = {v["secret"]["secretName"] for v in one(docs, "StatefulSet", "-worker")["spec"]["template"]["spec"]["volumes"]
                   if "secret" in v}
    assert secret_vols == {"lockgate-kafka", "kafka-ca"}
    auth = one(docs, "TriggerAuthentication")["spec"]["secretTargetRef"]
    assert {(a["parameter"], a["name"]) for a in auth} == {("password", "lockgate-kafka"), ("username", "lockgate-kafka"),
                                                          ("ca", "kafka-ca")}


def test_no_secret_material_in_default_values(tmp_path: Path) -> None:
    docs = render(tmp_path)
    assert not [d for d in docs if d["kind"] == "Secret"], "the chart must not create Secrets"
    text = (CHART / "values.yaml").read_text().lower()
    assert "sk-" not in text and "password:" not in text
