"""What a benchmark's figures were measured on: CPU model, the flags that decide which fast paths
exist, cores, clock, torch / oneDNN versions, the load average (the benchmark machine is shared:
a load above the core count means the figures are low), and the CPU time a process used (to show
that engines measured one after the other did not run at the same time)."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

MACHINE_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                 "amx_bf16", "amx_int8")  # the CPU flags that decide which fast paths exist


def _cpuinfo() -> tuple[str | None, set[str], list[float]]:
    model: str | None = None
    flags: set[str] = set()
    mhz: list[float] = []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags, mhz
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
        elif key == "cpu MHz":
            try:
                mhz.append(float(value))
            except ValueError:
                pass
    return model, flags, mhz


def _max_clock_mhz() -> float | None:
    """The CPU's rated maximum clock from cpufreq; None where the kernel does not expose it (most VMs)."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1000
    except (OSError, ValueError):
        return None


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def machine_info() -> dict:
    """The machine as the benchmark's JSON records it. ``clock_mhz_at_start`` is the mean current
    clock over the cores as /proc/cpuinfo reports it (on a VM: the host's nominal clock)."""
    import torch

    from engine_workers.kernels.cpu_kernels import isa_level

    model, flags, mhz = _cpuinfo()
    dnn = re.search(r"MKL-DNN (v[\d.]+)|oneDNN (v[\d.]+)", torch.__config__.show())
    affinity = getattr(os, "sched_getaffinity", None)
    return {"cpu_model": model or platform.processor() or "unknown",
            # the level the engine's kernels are built for (LOCKGATE_CPU_ISA or the CPU's best),
            # and oneDNN's / ATen's own caps where set (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY)
            "kernel_isa": isa_level(),
            "cpu_flags": {f: f in flags for f in MACHINE_FLAGS} if flags else None,
            "cpu_count": os.cpu_count(), "usable_cores": len(affinity(0)) if affinity else os.cpu_count(),
            "clock_mhz_at_start": round(sum(mhz) / len(mhz), 1) if mhz else None, "max_clock_mhz": _max_clock_mhz(),
            "torch": torch.__version__, "onednn": (dnn.group(1) or dnn.group(2)) if dnn else None,
            "torch_threads_default": torch.get_num_threads(),
            "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY",
                                                      "GOMP_SPINCOUNT", "LOCKGATE_THREADS", "LOCKGATE_CPU_ISA",
                                                      "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ},
            "loadavg_1_5_15_at_start": loadavg()}


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far (all its threads); None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # after the ")" that ends the command name, utime and stime are the 12th and 13th fields
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def describe(m: dict) -> str:
    """One line for a printout."""
    flags = m.get("cpu_flags") or {}
    have = ", ".join(f for f, on in flags.items() if on) or "unknown"
    lacks = ", ".join(f for f, on in flags.items() if not on)
    load = m.get("loadavg_1_5_15_at_start")
    load_s = "/".join(f"{v:.2f}" for v in load) if load else "unknown"
    clock = f"{m['clock_mhz_at_start']:.0f} MHz" if m.get("clock_mhz_at_start") else "clock unknown"
    if m.get("max_clock_mhz"):
        clock += f" (max {m['max_clock_mhz']:.0f})"
    isa = f", kernels {m['kernel_isa']}" if m.get("kernel_isa") else ""
    return (f"machine: {m['cpu_model']}{isa}, {m['usable_cores']} of {m['cpu_count']} cores, {clock}; flags {have}"
            f"{'; lacks ' + lacks if lacks else ''}; torch {m['torch']}, oneDNN {m['onednn']}; "
            f"load average at start {load_s} (1/5/15 min)")
