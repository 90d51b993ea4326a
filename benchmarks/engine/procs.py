"""One process per engine for ``lockgate bench engine``.

Why: torch's CPU ops parallelise with OpenMP, whose thread teams belong to a process. Engines in one
process share (and fight over) its pools: transformers' continuous batching steps on a thread of its
own, and a second thread running parallel torch ops makes every team of the process spin less and
sleep more (engine_workers/engine/torch_thread.py); the glibc malloc tuning lockgate's CPU engine
applies would also carry over to the HF engines. So each engine (lockgate, its ablation, HF static,
HF continuous) lives in a spawned process of its own, runs its torch work on that process's one
torch thread, and the parent asks one engine at a time to run: the others wait in a blocking pipe
read, their OpenMP threads asleep. The parent records the CPU seconds the waiting processes used
during each run, which shows that they did wait.

Protocol: the parent sends ``(op, args)``; the process answers ``("ok", value)`` or
``("error", message)``. Ops: ``info``, ``run(workload)``, ``gemm`` (lockgate only), ``close``.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from benchmarks.machine import process_cpu_seconds

if TYPE_CHECKING:
    from benchmarks.engine.workload import Workload
    from engine_workers.engine.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProcSpec:
    """What one engine process runs. ``kind``: lockgate | hf_static | hf_continuous."""

    name: str
    kind: str
    config: EngineConfig
    model_path: str | None = None  # HF: the folder lockgate loaded
    hf_dtype: str | None = None  # HF: the dtype it loads the model in (hf_baselines.hf_precision)
    threads: int | None = None  # HF: torch threads (lockgate's count); lockgate: from config.num_threads
    max_new_tokens: int = 96  # HF continuous: its generation config's default
    kv_tokens: int | None = None  # HF continuous: its KV cache (lockgate's budget)
    log_level: int = logging.WARNING


class EngineProcError(RuntimeError):
    pass


class _Lockgate:
    def __init__(self, spec: ProcSpec) -> None:
        from engine_workers.engine.core import Engine

        self.engine = Engine(spec.config)

    def info(self) -> dict:
        import torch

        from engine_workers.kernels.cpu_kernels import isa_level

        e = self.engine
        return {"model": str(e.loaded.path), "device": str(e.device), "dtype": str(e.dtype).removeprefix("torch."),
                "weights": e.weight_format, "kv_cache_dtype": str(e.kv_dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "spec": e.loaded.spec,
                "kv_blocks": e.kv.num_blocks, "block_size": e.kv.block_size, "max_model_len": e.max_model_len,
                "kernel_isa": isa_level() if e.device.type == "cpu" else None}

    def run(self, wl: Workload) -> dict:
        from lockgate_types import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in wl.outputs]
        computed0 = self.engine.stats.computed_tokens
        timer = None
        if self.engine.device.type == "cuda":
            from benchmarks.engine.steptime import StepTimer

            timer = StepTimer(self.engine.runner)
        _sync(self.engine.device)
        start = time.perf_counter()
        # A fresh prefix-cache salt per run: an earlier round's cached prompts must not make a later
        # round cheaper (the HF engines reuse nothing either).
        done = self.engine.generate(wl.prompts, params, cache_salt=uuid.uuid4().hex)
        _sync(self.engine.device)
        elapsed = time.perf_counter() - start
        steps = timer.close(elapsed) if timer is not None else None
        if [len(d.token_ids) for d in done] != wl.outputs:
            raise RuntimeError("lockgate made other token counts than the workload asked for")
        if any(d.num_cached_tokens for d in done):
            raise RuntimeError("bench run reused cached prefixes; its timing would not be comparable")
        out: dict = {"seconds": elapsed, "computed_tokens": self.engine.stats.computed_tokens - computed0}
        if steps is not None:
            out["step_breakdown"] = steps
        return out

    def gemm(self) -> dict[str, float]:
        from benchmarks.engine.roofline import measure_gemm_flops

        return measure_gemm_flops() if self.engine.device.type == "cpu" else {}

    def close(self) -> None:
        pass


class _HF:
    def __init__(self, spec: ProcSpec) -> None:
        import torch

        from benchmarks.engine.hf_baselines import HFContinuous, HFStatic, load_model

        if spec.threads:
            torch.set_num_threads(spec.threads)
        assert spec.model_path and spec.hf_dtype
        model = load_model(spec.model_path, spec.config.resolved_device(), spec.hf_dtype)
        self.dtype = str(model.dtype).removeprefix("torch.")
        self.impl = HFContinuous(model, spec.max_new_tokens, spec.kv_tokens) if spec.kind == "hf_continuous" \
            else HFStatic(model)

    def info(self) -> dict:
        import torch

        return {"dtype": self.dtype, "threads": torch.get_num_threads(), "kv_tokens": getattr(self.impl, "kv_tokens", None)}

    def run(self, wl: Workload) -> dict:
        return {"seconds": self.impl.run(wl)}

    def close(self) -> None:
        self.impl.close()


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _serve(conn, spec: ProcSpec) -> None:
    try:
        runner: Any = _Lockgate(spec) if spec.kind == "lockgate" else _HF(spec)
        conn.send(("ok", runner.info()))
    except Exception as exc:
        log.exception("%s: set-up failed", spec.name)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        op, args = conn.recv()
        try:
            value = getattr(runner, op)(*args)
        except Exception as exc:  # handed to the parent, which decides whether the bench goes on
            log.exception("%s: %s failed", spec.name, op)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", value))
        if op == "close":
            return


def _main(conn, spec: ProcSpec) -> None:
    from engine_workers.engine import torch_thread

    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s {spec.name} %(levelname)s %(name)s: %(message)s")
    torch_thread.call(_serve, conn, spec)  # every torch op of this process on its one torch thread


class EngineProc:
    """The parent's handle on one engine process. Start several, then :meth:`ready` each."""

    def __init__(self, spec: ProcSpec) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that has imported torch
        self.spec = spec
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_main, args=(child, spec), name=f"bench-{spec.name}", daemon=True)
        self._proc.start()
        child.close()
        self._start = time.perf_counter()
        self.info: dict = {}

    @property
    def name(self) -> str:
        return self.spec.name

    def _recv(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineProcError(f"{self.name}: engine process exited (code {self._proc.exitcode})") from None
        if status != "ok":
            raise EngineProcError(f"{self.name}: {value}")
        return value

    def ready(self) -> dict:
        """Wait for the engine's set-up; its info, with ``setup_s`` (process start to ready)."""
        self.info = self._recv()
        self.info["setup_s"] = time.perf_counter() - self._start
        self.info["pid"] = self._proc.pid
        return self.info

    def call(self, op: str, *args) -> Any:
        self._conn.send((op, args))
        return self._recv()

    def cpu_seconds(self) -> float | None:
        return process_cpu_seconds(self._proc.pid) if self._proc.pid else None

    def close(self) -> None:
        """Shut the engine down: its process, OpenMP pool and memory go with it."""
        if self._proc.is_alive():
            try:
                self.call("close")
            except (EngineProcError, OSError):
                pass
            self._proc.join(30)
        if self._proc.is_alive():
            log.warning("%s did not exit; terminating it", self.name)
            self._proc.terminate()
            self._proc.join(10)
        self._conn.close()


def timed_run(proc: EngineProc, others: list[EngineProc], wl: Workload) -> dict:
    """``proc`` runs the workload once; the result also has the most CPU seconds any waiting
    engine process used meanwhile (near 0: nothing ran beside the measured engine)."""
    before = [o.cpu_seconds() for o in others]
    out = proc.call("run", wl)
    after = [o.cpu_seconds() for o in others]
    used = [a - b for a, b in zip(after, before) if a is not None and b is not None]
    out["others_cpu_s"] = max(used, default=0.0)
    return out

