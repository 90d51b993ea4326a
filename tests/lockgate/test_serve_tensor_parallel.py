"""The bar of issue #33: ``lockgate serve --tensor-parallel-size 2`` (its ranks launched by lockgate
itself) answers greedy ``/v1/completions`` with exactly the text of ``--tensor-parallel-size 1``.
Both servers run as the user runs them (``python -m lockgate.cli serve``, in-memory bus)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(model: str, tp: int, err) -> tuple[subprocess.Popen, int]:
    port = _port()
    args = ["serve", "--model", model, "--port", "0", "--openai-port", str(port), "--kv-cache-bytes", "8M",
            "--bus", f"memory://tp{tp}", "--tensor-parallel-size", str(tp)]
    env = dict(os.environ, LOCKGATE_LOG_LEVEL="WARNING")
    return subprocess.Popen([sys.executable, "-m", "lockgate.cli", *args], stdout=subprocess.PIPE, stderr=err,
                            env=env), port


def _wait_ready(proc: subprocess.Popen, err_path) -> None:
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    line = b""
    while b"OpenAI-compatible API" not in line:
        assert time.monotonic() < deadline and proc.poll() is None, err_path.read_text()[-3000:]
        line = proc.stdout.readline()


def _complete(port: int, prompt: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 20, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    return out["choices"][0]["text"]


def test_serve_tp2_completions_equal_tp1(tiny_model_dir, tmp_path):
    procs, files = [], {}
    try:
        errs = {tp: tmp_path / f"serve-tp{tp}.txt" for tp in (1, 2)}
        files = {tp: open(errs[tp], "wb") for tp in (1, 2)}
        started = {tp: _start(tiny_model_dir, tp, files[tp]) for tp in (1, 2)}  # both load at once
        procs = [p for p, _ in started.values()]
        for tp, (proc, _) in started.items():
            _wait_ready(proc, errs[tp])
        prompts = ["The three primary colours are", "def add(a, b):\n    return"]
        texts = {tp: [_complete(port, p) for p in prompts] for tp, (_, port) in started.items()}
        assert all(texts[1]) and texts[2] == texts[1], texts
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        assert [proc.wait(60) for proc in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for f in files.values():
            f.close()


def test_serve_exits_nonzero_when_a_rank_dies(tiny_model_dir, tmp_path):
    """kill -9 of rank 1: the next request fails with an error (not a hang), and the serving process
    exits non-zero within a bounded time, as a worker killed outright would."""
    import urllib.error

    import psutil

    err_path = tmp_path / "serve.txt"
    with open(err_path, "wb") as err:
        proc, port = _start(tiny_model_dir, 2, err)
        try:
            _wait_ready(proc, err_path)
            assert _complete(port, "hello")
            (rank1,) = [c for c in psutil.Process(proc.pid).children() if "parallel.follower" in " ".join(c.cmdline())]
            rank1.kill()
            deadline = time.monotonic() + 10  # dead: a zombie until its parent (the server) reaps it
            while rank1.is_running() and rank1.status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            t0 = time.monotonic()
            try:
                _complete(port, "hello again")
            except (urllib.error.HTTPError, urllib.error.URLError, ConnectionError, OSError):
                pass  # an error status, or the connection closed by the exiting server
            assert proc.wait(60) != 0
            assert time.monotonic() - t0 < 60
            assert "rank 1 exited with code -9" in err_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
