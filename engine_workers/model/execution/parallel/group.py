"""The tensor-parallel group as rank 0 sees it: the gloo process group, the other ranks' processes
and the control channel to them.

Rank 0 is the engine's own process; ranks 1..N-1 are child processes it starts
(``python -m engine_workers.model.execution.parallel.follower``). Two channels, for two jobs:

* **control**: each child's stdin carries length-prefixed pickled frames from rank 0 (load this
  model, build the runner with this many blocks, run a step of this many int64s, quit), and its
  stdout answers ``ready`` lines. A child blocks on its stdin while the engine is idle, with no
  timeout, and reads EOF the moment rank 0 dies (even by kill -9): it then exits, so no rank outlives
  its group.
* **data**: the gloo process group over 127.0.0.1 (a free port): the step's broadcast and the
  model's all-reduces and gather, each bounded by ``timeout_s``.

Failure: a child that exits or a collective that fails (gloo reports a closed peer at once, a hung
one after ``timeout_s``) raises :class:`TensorParallelError` naming the rank and its exit code; the
group is then broken for good (every later call raises the same) and the engine's step loop crashes
with it, as if the worker were killed.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine_workers.model.loading.sharding.layout import TensorParallelError

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # one broadcast / all-reduce; a dead peer is reported sooner (closed socket)
READY_TIMEOUT_S = 600.0  # a rank loading its shard and building its cache


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_env() -> None:
    """Keep gloo's sockets on the loopback interface (its default is the host name's address)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def write_frame(stream, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def read_frame(stream) -> object | None:
    """The next frame, or None at EOF (rank 0 is gone)."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


class TpGroup:
    """Rank 0's handle. Not thread-safe: the engine's torch thread makes every call."""

    def __init__(self, world: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        if world < 2:
            raise TensorParallelError(f"a tensor-parallel group needs >= 2 ranks, got {world}")
        if dist.is_initialized():
            raise TensorParallelError("this process already has a torch.distributed group (one TP engine per process)")
        self.world, self.timeout_s = world, timeout_s
        self.broken: TensorParallelError | None = None
        port = free_port()
        gloo_env()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs: list[subprocess.Popen] = []
        self._pending: dict[int, bytes] = {}  # per rank: stdout read past its last ``ready``
        try:
            for rank in range(1, world):  # one by one, so a failed start kills the ranks already started
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "engine_workers.model.execution.parallel.follower", str(rank), str(world),
                     str(port), str(timeout_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env))
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        except Exception as exc:
            self._kill()
            raise TensorParallelError(f"tensor-parallel group of {world} did not form on 127.0.0.1:{port}: "
                                      f"{self._ranks_state()}: {exc}") from None
        log.info("tensor-parallel group: %d ranks (gloo on 127.0.0.1:%d), ranks 1..%d pids %s", world, port,
                 world - 1, [p.pid for p in self.procs])

    # -- control ----------------------------------------------------------------------------------

    def _ranks_state(self) -> str:
        parts = []
        for rank, p in enumerate(self.procs, start=1):
            rc = p.poll()
            parts.append(f"rank {rank} " + ("running" if rc is None else f"exited with code {rc}"))
        return ", ".join(parts)

    def check(self) -> None:
        """Raise if the group is broken or a rank has exited."""
        if self.broken is not None:
            raise self.broken
        for rank, p in enumerate(self.procs, start=1):
            rc = p.poll()
            if rc is not None:
                self.fail(f"rank {rank} of {self.world} exited with code {rc}")

    def fail(self, why: str, exc: BaseException | None = None) -> TensorParallelError:
        """Mark the group broken (for good), stop the other ranks, raise."""
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self.broken = TensorParallelError(f"tensor-parallel group failed: {why} ({self._ranks_state()}){detail}")
        log.error("%s", self.broken)
        self._kill()
        raise self.broken

    def send(self, frame: object) -> None:
        self.check()
        for rank, p in enumerate(self.procs, start=1):
            try:
                write_frame(p.stdin, frame)
            except (BrokenPipeError, OSError) as exc:
                self.fail(f"rank {rank}'s control pipe closed", exc)

    def wait_ready(self, what: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Every other rank's ``ready`` line, each within ``timeout_s`` (raises if one exits first).

        Reads the pipe's file descriptor unbuffered: with a buffered ``readline`` a ``ready`` that
        arrived in one chunk with other output would sit in Python's buffer while ``select`` waits
        on a descriptor with nothing left to read."""
        deadline = time.monotonic() + timeout_s
        for rank, p in enumerate(self.procs, start=1):
            assert p.stdout is not None
            fd = p.stdout.fileno()
            pending = self._pending.get(rank, b"")
            while b"ready" not in pending.split(b"\n")[:-1]:  # complete lines only
                self.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    self.fail(f"rank {rank} not ready ({what}) after {timeout_s:.0f} s")
                readable, _, _ = select.select([fd], [], [], min(left, 0.5))
                if not readable:
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:  # EOF: it is exiting; check() reports its code
                    try:
                        p.wait(timeout=self.timeout_s)
                    except subprocess.TimeoutExpired as exc:
                        self.fail(f"rank {rank} closed its stdout but did not exit", exc)
                    continue
                pending += chunk
            lines = pending.split(b"\n")
            # keep what came after this ``ready`` for the next wait (a later load's line)
            self._pending[rank] = b"\n".join(lines[lines.index(b"ready") + 1:])

    # -- data -------------------------------------------------------------------------------------

    def broadcast_step(self, flat: torch.Tensor) -> None:
        """Tell the other ranks a step of ``flat.numel()`` int64s comes, then broadcast it."""
        self.send(("step", flat.numel()))
        try:
            dist.broadcast(flat, src=0)
        except RuntimeError as exc:
            self.fail("the step broadcast failed", exc)

    def collective_failed(self, exc: BaseException) -> TensorParallelError:
        """A collective inside the forward raised: give a dead rank a moment to be seen exited."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        try:
            self.fail("a collective of the forward failed", exc)
        except TensorParallelError as err:
            return err
        raise AssertionError("unreachable")

    # -- teardown ---------------------------------------------------------------------------------

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel rank pid %d did not exit after SIGKILL", p.pid)
            for pipe in (p.stdin, p.stdout):
                if pipe is not None and not pipe.closed:
                    try:
                        pipe.close()
                    except OSError:  # a broken pipe's buffered bytes cannot be flushed: nothing to keep
                        pass
        if dist.is_initialized():
            # a broken group cannot be destroyed collectively; dropping our side is enough
            dist.destroy_process_group()

    def close(self) -> None:
        """Ask the other ranks to quit, wait a bounded time, then kill what is left."""
        if self.broken is None:
            for p in self.procs:
                try:
                    write_frame(p.stdin, ("quit",))
                    p.stdin.close()  # type: ignore[union-attr]
                except (BrokenPipeError, OSError):
                    pass
            for p in self.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self._kill()
