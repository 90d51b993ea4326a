"""Whether every kernel of the engine's CPU extension module builds and passes its check here:
:func:`problems`, which ``make model`` prints so the build (~1-2 min) happens at install time, not
in the first test or request.

The kernels are resolved in their own modules (:mod:`engine_workers.kernels.cpu_kernels`, which
builds the module, and :mod:`~engine_workers.kernels.lowp_kernels`,
:mod:`~engine_workers.kernels.cpu_blocks`, :mod:`~engine_workers.kernels.w8a8_linear`,
:mod:`~engine_workers.kernels.amx_linear`, which
import it); this module sits above them all, so none of them imports another to list the rest.

A CPU that lacks a flag a kernel is fast with (avx512_bf16, AVX-512, AVX2) is not a problem here:
the module is built for the process's ISA level (:func:`engine_workers.kernels.cpu_kernels.isa_level`),
so each kernel still compiles (AVX2 forms, or plain loops) and must pass its check; whether a mode
is worth running on this CPU is the engine's decision at load
(:func:`engine_workers.kernels.cpu_linear.lowp_problem`), which names the missing flags.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_workers.kernels import amx_linear, cpu_blocks, cpu_kernels, lowp_kernels, w8a8_linear

# Each kernel's "why not, or None", in the order problems() reports them (attention first: it is
# on every CPU float32 engine's path; the weight formats only under their flags).
CHECKS: tuple[tuple[str, Callable[[], str | None]], ...] = (
    ("paged decode attention", cpu_kernels.problem),
    ("prefill attention", cpu_kernels.prefill_problem),
    ("small-batch linear", cpu_kernels.small_m_problem),
    ("fused elementwise", cpu_kernels.fused_problem),
    ("bf16/int8 linear", lowp_kernels.lowp_problem),
    ("Q4_1/Q8_0 block linear", cpu_blocks.block_problem),
    ("W8A8 linear", w8a8_linear.w8a8_kernel_problem),
    ("AMX tile bf16 linear", amx_linear.tiles_kernel_problem),  # at the amx level only
)


def problems() -> str | None:
    """Build and check every kernel; the first reason one is unavailable (naming the kernel), or
    ``None`` when all are ready."""
    for name, problem in CHECKS:
        why = problem()
        if why is not None:
            return f"{name}: {why}"
    return None
