"""CPU ISA levels of the engine's kernels, as pure functions of the CPU's flags: which levels exist,
which CPU flags each needs, the compiler flags of each, the best level a CPU runs, and the check of a
forced level (``LOCKGATE_CPU_ISA``). No torch, no build: :mod:`engine_workers.kernels.cpu_kernels`
builds and loads the module for the level chosen here (docs/design-history.md, "ISA levels")."""

from __future__ import annotations

from pathlib import Path

ISA_ENV = "LOCKGATE_CPU_ISA"
ISA_LEVELS = ("avx2", "avx512", "amx")  # the levels LOCKGATE_CPU_ISA accepts, lowest first
# the CPU flags (/proc/cpuinfo names) each level needs, and its compiler flags
_AVX512 = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")
ISA_NEEDS = {"avx2": ("avx2", "fma", "f16c"), "avx512": _AVX512,
             # AMX tiles with bf16 dot products (Sapphire Rapids and later); amx_tile alone is not
             # enough: the tiles' bf16 GEMMs (oneDNN's, through torch) need amx_bf16 as well
             "amx": (*_AVX512, "amx_tile", "amx_bf16")}
_AVX512_CFLAGS = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# The amx level is its own build: the avx512 kernels plus the AMX tile bf16 GEMM
# (csrc/amx_bf16.cpp, which compiles to a stub without these flags); no other level gets them.
ISA_CFLAGS = {"generic": [], "avx2": ["-mavx2", "-mfma", "-mf16c"], "avx512": _AVX512_CFLAGS,
              "amx": [*_AVX512_CFLAGS, "-mamx-tile", "-mamx-bf16"]}
# extensions an avx512 (or amx) build also enables where the CPU has them (the kernels test their
# macros: AVX512-BF16 dot products, AVX512-FP16 prefill values; VNNI for oneDNN-style int8 code)
_AVX512_OPTIONAL = (("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", "-mavx512bf16"), ("avx512_fp16", "-mavx512fp16"))
ISA_OPTIONAL = {"avx512": _AVX512_OPTIONAL, "amx": _AVX512_OPTIONAL}


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_isa(flags: set[str] | None = None) -> str:
    """The best ISA level ``flags`` (default: this CPU's) support: ``"avx512"``, ``"avx2"`` or
    ``"generic"`` (plain loops, every fast mode refused). Where /proc/cpuinfo is missing, the
    compiler's own ``-march=native`` is not consulted: ``"generic"``."""
    flags = cpu_flags() if flags is None else flags
    for level in reversed(ISA_LEVELS):
        if all(f in flags for f in ISA_NEEDS[level]):
            return level
    return "generic"


def parse_isa(value: str, flags: set[str] | None = None) -> str:
    """``value`` of ``LOCKGATE_CPU_ISA`` checked: one of :data:`ISA_LEVELS` the CPU can run. Raises
    ``ValueError`` naming the choices (a bad value) or the CPU flags missing (a level above the
    host's: its code would stop on an illegal instruction)."""
    level = value.strip().lower()
    if level not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LEVELS)}; got {value!r}")
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in ISA_NEEDS[level] if f not in flags]
    if missing:
        raise ValueError(f"{ISA_ENV}={level}: this CPU lacks {', '.join(missing)} "
                         f"(it can run {host_isa(flags)})")
    return level


def level_cflags(level: str, flags: set[str]) -> list[str]:
    """The ISA compiler flags of a ``level`` build on a CPU with ``flags``: the level's own, plus the
    optional extensions (:data:`ISA_OPTIONAL`) this CPU has."""
    return [*ISA_CFLAGS[level], *(opt for flag, opt in ISA_OPTIONAL.get(level, ()) if flag in flags)]
