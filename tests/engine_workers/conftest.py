"""The ``isa`` fixture: a test module that uses it (``pytestmark = pytest.mark.usefixtures("isa")``,
and its module-scoped fixtures taking ``isa``) runs once per kernel ISA level this host can run
(engine_workers/kernels/cpu_kernels.py, ISA levels): on an AVX-512 host both the avx512 build and
the avx2 build, so the AVX2 code is run and checked here too, not only on AVX2-only hosts (on an
AMX host the amx level as well: its own build, the avx512 kernels plus the AMX tile bf16 GEMM). The
first use of a level in a process builds it (about 3 minutes on 2 cores, then cached)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_workers.kernels import cpu_kernels
from engine_workers.kernels import isa as isa_levels


def host_levels() -> list[str]:
    best = isa_levels.host_isa()
    return [lv for lv in isa_levels.ISA_LEVELS if best in isa_levels.ISA_LEVELS
            and isa_levels.ISA_LEVELS.index(lv) <= isa_levels.ISA_LEVELS.index(best)] or [best]


@pytest.fixture(scope="module", params=host_levels())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param not in isa_levels.ISA_LEVELS:  # "generic": nothing to force
        yield request.param
        return
    level = cpu_kernels.use_isa(request.param)
    try:
        yield level
    finally:
        cpu_kernels.use_isa(None)
