"""Edge processes for fault tests (kill -9 one, start another cold): ``lockgate edge`` on a test
namespace, with a key file, its OpenAI API on a port of its own. Not a test module."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from edge.config import add_key
from tests.engine_workers.worker.test_worker_kafka import LOCKGATE, free_port, kafka_url
from tests.waiting import wait_until


def ready(port: int) -> bool:
    """The edge's OpenAI ``/ready``: its reply consumer runs and a worker heartbeat is fresh."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class EdgeFleet:
    """``lockgate edge`` processes of one namespace; ``keys``: tenant -> clear API key."""

    def __init__(self, bootstrap: str, model_dir: Path, namespace: str, partitions: int, workdir: Path,
                 tenants: tuple[str, ...] = ("alice", "bob")) -> None:
        self.bootstrap, self.model_dir, self.namespace, self.partitions = bootstrap, model_dir, namespace, partitions
        self.workdir = workdir
        self.key_file = workdir / "keys.jsonl"
        self.keys = {t: add_key(self.key_file, t, 1, requests_per_min=0, tokens_per_min=0, max_streams=0)[0]
                     for t in tenants}
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.ws_ports: dict[str, int] = {}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}/v1"

    def spawn(self, name: str) -> None:
        self.ports[name], self.ws_ports[name] = free_port(), free_port()
        cmd = [LOCKGATE, "--log-level", "WARNING", "edge", "--bus", kafka_url(self.bootstrap),
               "--model", str(self.model_dir), "--namespace", self.namespace, "--partitions", str(self.partitions),
               "--port", str(self.ws_ports[name]), "--openai-port", str(self.ports[name]), "--keys",
               str(self.key_file), "--edge-id", name]
        with (self.workdir / f"{name}.log").open("w") as err:
            self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)

    async def start(self, *names: str, timeout: float = 120) -> None:
        """Spawn ``names`` and wait until each is ready (a worker must be heartbeating)."""
        for n in names:
            self.spawn(n)
        for n in names:
            await self._ready(n, timeout)

    async def _ready(self, n: str, timeout: float) -> None:
        port, proc = self.ports[n], self.procs[n]
        await wait_until(lambda: proc.poll() is not None or asyncio.to_thread(ready, port), timeout=timeout,
                         interval=0.2, message=lambda: f"edge {n} not ready: {self.log(n)[-2000:]}")
        assert proc.poll() is None, f"edge {n} exited: {self.log(n)[-2000:]}"

    def kill(self, name: str) -> None:
        """kill -9: no Cancel, no goodbye; its streams' clients see the connection drop."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(10)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(OSError):
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs.clear()
