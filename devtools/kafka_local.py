"""A real Apache Kafka (KRaft) on loopback for development, tests and fault drills.

``lockgate kafka start|stop|status [--nodes 1|3] [--port 9092] [--dir ~/.cache/lockgate/kafka]``
(also ``scripts/kafka.sh``, and :func:`start` for test fixtures). Pure standard library.

* Jars: fetched once with Maven from ``scripts/kafka/pom.xml`` into ``<dir>/libs``; a stamp holding
  the pom's SHA-256 makes an edited pom refetch.
* Cluster ``<dir>/cluster-<nodes>n-<port>/node-<i>/``: ``server.properties``, ``log4j2.properties``,
  ``data/`` (KRaft storage, formatted once with a shared cluster id and a static voter set),
  ``logs/server.log``, ``stdout.log``, ``kafka.pid``. Node ``i`` serves clients on
  ``127.0.0.1:<port+i>`` and its controller on ``127.0.0.1:<port+100+i>``; every node is
  ``broker,controller``. Data persists across restarts (``--fresh`` wipes it).
* ``start`` is idempotent (running nodes are left alone) and returns once every node answers a
  Kafka ``Metadata`` request listing all brokers, else raises :class:`KafkaLocalError` with the log
  tail. ``stop`` signals only pids from our pidfiles whose command line is our ``kafka.Kafka`` with
  our properties file (never a reused pid), SIGTERM then SIGKILL after a grace period.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # devtools/kafka_local.py -> the repository
POM = REPO / "scripts" / "kafka" / "pom.xml"
DEFAULT_DIR = Path(os.environ.get("LOCKGATE_KAFKA_DIR", "~/.cache/lockgate/kafka")).expanduser()
CONTROLLER_PORT_OFFSET = 100
# The local broker shares a small machine with the engine it feeds, so its flags buy low CPU, not
# peak throughput: C1-only JIT (C2 compiling Kafka's hot paths burned seconds of CPU during a
# benchmark's first minute) and the serial collector (no concurrent GC threads; the heap is small
# and pauses are short). Together they cut the broker's CPU over a `lockgate bench e2e`
# run (figures in docs/bus.md, A real broker locally and in CI). LOCKGATE_KAFKA_JVM_FLAGS
# replaces the whole list.
JVM_FLAGS = [
    "-Xms256m", "-Xmx512m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1", "-XX:CICompilerCount=1",
    "-XX:+ExitOnOutOfMemoryError",
    "-Xshare:auto",
    "-Djava.awt.headless=true",
]


class KafkaLocalError(RuntimeError):
    """The local broker could not be fetched, formatted, started or stopped; the text says why."""


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    nodes: int
    port: int
    directory: Path
    bootstrap: str  # "127.0.0.1:9092[,127.0.0.1:9093,...]"
    pids: tuple[int | None, ...]  # per node; None = not running

    @property
    def running(self) -> bool:
        return all(p is not None for p in self.pids)


def _cluster_dir(base: Path, nodes: int, port: int) -> Path:
    return base / f"cluster-{nodes}n-{port}"


def _check(nodes: int, port: int) -> None:
    if nodes not in (1, 3):
        raise ValueError(f"--nodes must be 1 or 3, got {nodes}")
    if not 1024 <= port <= 65535 - CONTROLLER_PORT_OFFSET - nodes:
        raise ValueError(f"--port must be in [1024, {65535 - CONTROLLER_PORT_OFFSET - nodes}], got {port}")


# --- jars ------------------------------------------------------------------------------------------


def fetch_jars(base: Path = DEFAULT_DIR) -> Path:
    """``<base>/libs`` with the broker jars, fetching them with Maven when missing or stale."""
    libs = base / "libs"
    stamp = base / "libs.sha256"
    want = hashlib.sha256(POM.read_bytes()).hexdigest()
    if libs.is_dir() and stamp.is_file() and stamp.read_text().strip() == want and any(libs.glob("kafka_*.jar")):
        return libs
    if shutil.which("mvn") is None:
        raise KafkaLocalError("Maven (mvn) is needed once to fetch the Kafka jars: apt-get install -y maven")
    shutil.rmtree(libs, ignore_errors=True)
    base.mkdir(parents=True, exist_ok=True)
    cmd = ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
           f"-DoutputDirectory={libs}", "-DincludeScope=runtime"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not any(libs.glob("kafka_*.jar")):
        raise KafkaLocalError(f"fetching Kafka jars failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    stamp.write_text(want + "\n")
    return libs


# --- configuration ---------------------------------------------------------------------------------


def _server_properties(node: int, nodes: int, port: int, node_dir: Path) -> str:
    voters = ",".join(f"{i}@127.0.0.1:{port + CONTROLLER_PORT_OFFSET + i}" for i in range(nodes))
    rf = nodes
    isr = 2 if nodes >= 3 else 1
    return f"""# written by lockgate kafka start; edits are overwritten
process.roles=broker,controller
node.id={node}
controller.quorum.voters={voters}
listeners=PLAINTEXT://127.0.0.1:{port + node},CONTROLLER://127.0.0.1:{port + CONTROLLER_PORT_OFFSET + node}
advertised.listeners=PLAINTEXT://127.0.0.1:{port + node}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={node_dir / "data"}
num.partitions=1
default.replication.factor={rf}
min.insync.replicas={isr}
auto.create.topics.enable=true
offsets.topic.replication.factor={rf}
offsets.topic.num.partitions=8
transaction.state.log.replication.factor={rf}
transaction.state.log.min.isr={isr}
share.coordinator.state.topic.replication.factor={rf}
share.coordinator.state.topic.min.isr={isr}
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=2
num.recovery.threads.per.data.dir=1
log.retention.hours=168
log.segment.bytes=67108864
"""


def _log4j2_properties(node_dir: Path) -> str:
    return f"""# written by lockgate kafka start: everything to logs/server.log, nothing to the console
status = error
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = {node_dir / "logs" / "server.log"}
appender.file.filePattern = {node_dir / "logs" / "server.log.%i"}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 20MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 2
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
logger.raftserver.name = kafka.server.KafkaRaftServer
logger.raftserver.level = INFO
"""


def _kafka_uuid() -> str:
    """A Kafka-style cluster id (22 characters of URL-safe base64). Never one that starts with '-',
    as Kafka's own ``Uuid.randomUuid`` avoids: a command line takes it for an option (1 in 64 of
    them did, and formatting a fresh cluster failed: "--cluster-id/-t: expected one argument")."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


def _java(libs: Path, node_dir: Path) -> list[str]:
    java = shutil.which("java")
    if java is None:
        raise KafkaLocalError("Java 17+ is needed to run the local Kafka broker: apt-get install -y openjdk-17-jre-headless")
    extra = os.environ.get("LOCKGATE_KAFKA_JVM_FLAGS", "").split()
    return [java, *(extra or JVM_FLAGS), f"-Dlog4j2.configurationFile={node_dir / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={node_dir / 'logs'}", "-cp", f"{libs}/*"]


def _prepare(libs: Path, cdir: Path, nodes: int, port: int) -> None:
    """Write configs; format each node's storage once with the cluster's id."""
    cdir.mkdir(parents=True, exist_ok=True)
    id_file = cdir / "cluster.id"
    if not id_file.is_file():
        id_file.write_text(_kafka_uuid() + "\n")
    cluster_id = id_file.read_text().strip()
    for i in range(nodes):
        nd = cdir / f"node-{i}"
        (nd / "logs").mkdir(parents=True, exist_ok=True)
        (nd / "server.properties").write_text(_server_properties(i, nodes, port, nd))
        (nd / "log4j2.properties").write_text(_log4j2_properties(nd))
        if (nd / "data" / "meta.properties").is_file():
            continue
        # `--cluster-id=ID`, one token: an id written by an older version may start with '-'
        cmd = [*_java(libs, nd), "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",
               "-c", str(nd / "server.properties"), "--ignore-formatted"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            raise KafkaLocalError(f"formatting KRaft storage of node {i} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


# --- processes -------------------------------------------------------------------------------------


def _our_pid(nd: Path) -> int | None:
    """The pid in ``nd/kafka.pid`` if that process is alive and is our broker for this node."""
    try:
        pid = int((nd / "kafka.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    props = str(nd / "server.properties").encode()
    if b"kafka.Kafka" in cmdline and props in cmdline:
        return pid
    return None


def status(nodes: int = 1, port: int = 9092, base: Path = DEFAULT_DIR) -> ClusterInfo:
    _check(nodes, port)
    cdir = _cluster_dir(base, nodes, port)
    pids = tuple(_our_pid(cdir / f"node-{i}") for i in range(nodes))
    bootstrap = ",".join(f"127.0.0.1:{port + i}" for i in range(nodes))
    return ClusterInfo(nodes, port, cdir, bootstrap, pids)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def metadata_brokers(host: str, port: int, timeout_s: float = 2.0) -> int:
    """Send a Kafka ``Metadata`` v4 request (all topics, no auto-create); return how many brokers the
    answer lists. Raises ``OSError``/``ValueError`` when the port does not answer like a broker."""
    client = b"lockgate-probe"
    body = struct.pack(">hhih", 3, 4, 7, len(client)) + client + struct.pack(">ib", -1, 0)
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.settimeout(timeout_s)
        s.sendall(struct.pack(">i", len(body)) + body)
        head = _recv(s, 4)
        (size,) = struct.unpack(">i", head)
        resp = _recv(s, size)
    correlation, _throttle, brokers = struct.unpack(">iii", resp[:12])
    if correlation != 7:
        raise ValueError(f"unexpected correlation id {correlation}")
    return brokers


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return buf


def _log_tail(nd: Path, lines: int = 40) -> str:
    out = []
    for f in (nd / "stdout.log", nd / "logs" / "server.log"):
        if f.is_file():
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(out) or "(no logs)"


def start(nodes: int = 1, port: int = 9092, base: Path = DEFAULT_DIR, timeout_s: float = 120.0,
          fresh: bool = False) -> ClusterInfo:
    """Start the cluster (idempotent) and wait until every node answers; see the module docstring."""
    _check(nodes, port)
    base = Path(base).expanduser()
    cdir = _cluster_dir(base, nodes, port)
    if fresh:
        stop(nodes, port, base)
        shutil.rmtree(cdir, ignore_errors=True)
    info = status(nodes, port, base)
    if not info.running:
        libs = fetch_jars(base)
        _prepare(libs, cdir, nodes, port)
        for i, pid in enumerate(info.pids):
            if pid is not None:
                continue
            for p in (port + i, port + CONTROLLER_PORT_OFFSET + i):
                if _port_open(p):
                    raise KafkaLocalError(f"port 127.0.0.1:{p} is already in use by another process; choose --port")
            nd = cdir / f"node-{i}"
            pid = _spawn([*_java(libs, nd), "kafka.Kafka", str(nd / "server.properties")], nd)
            (nd / "kafka.pid").write_text(f"{pid}\n")
    _wait_ready(cdir, nodes, port, timeout_s)
    return status(nodes, port, base)


def _spawn(cmd: list[str], nd: Path) -> int:
    """Start ``cmd`` detached (own session, reparented to init, output to ``nd/stdout.log``) and
    return its pid. A shell does the fork so no ``Popen`` object of ours outlives this call."""
    script = 'cd "$1" && shift && "$@" >>stdout.log 2>&1 </dev/null & echo $!'
    proc = subprocess.run(["sh", "-c", script, "sh", str(nd), *cmd], capture_output=True, text=True,
                          timeout=30, start_new_session=True, check=False)
    try:
        return int(proc.stdout.strip())
    except ValueError:
        raise KafkaLocalError(f"could not start the Kafka broker: {proc.stderr.strip()}") from None


def _wait_ready(cdir: Path, nodes: int, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(range(nodes))
    last: Exception | None = None
    while pending:
        for i in sorted(pending):
            nd = cdir / f"node-{i}"
            if _our_pid(nd) is None:
                raise KafkaLocalError(f"Kafka node {i} exited during start-up:\n{_log_tail(nd)}")
            try:
                if metadata_brokers("127.0.0.1", port + i) >= nodes:
                    pending.discard(i)
            except (OSError, ValueError, struct.error) as exc:
                last = exc
        if not pending:
            return
        if time.monotonic() > deadline:
            i = min(pending)
            raise KafkaLocalError(
                f"Kafka node {i} did not answer on 127.0.0.1:{port + i} within {timeout_s:g}s ({last!r}):\n"
                f"{_log_tail(cdir / f'node-{i}')}"
            )
        time.sleep(0.25)


def stop(nodes: int = 1, port: int = 9092, base: Path = DEFAULT_DIR, grace_s: float = 30.0) -> list[int]:
    """Stop the nodes we started (SIGTERM, SIGKILL after ``grace_s``); return the pids stopped."""
    base = Path(base).expanduser()
    cdir = _cluster_dir(base, nodes, port)
    stopped = []
    for i in range(nodes):
        nd = cdir / f"node-{i}"
        pid = _our_pid(nd)
        if pid is None:
            continue
        os.kill(pid, signal.SIGTERM)
        stopped.append(pid)
    deadline = time.monotonic() + grace_s
    for i in range(nodes):
        nd = cdir / f"node-{i}"
        while _our_pid(nd) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = _our_pid(nd)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        (nd / "kafka.pid").unlink(missing_ok=True)
    return stopped


def stop_node(node: int, nodes: int = 3, port: int = 9092, base: Path = DEFAULT_DIR, kill: bool = False) -> int | None:
    """Stop one node of a running cluster (fault drills); ``start`` brings it back. Returns its pid."""
    nd = _cluster_dir(Path(base).expanduser(), nodes, port) / f"node-{node}"
    pid = _our_pid(nd)
    if pid is not None:
        os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
    return pid
