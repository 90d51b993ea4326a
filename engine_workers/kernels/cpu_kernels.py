"""The engine's own CPU kernels (float32 math), one extension module (``csrc/module.cpp``) built on first use:

* paged decode attention (``csrc/paged_decode.cpp``): reads K/V in place from the blocks, each
  context cut into 128-token units spread evenly over the threads (AVX-512 builds, head sizes
  32/64/128; one task per sequence otherwise). Through SDPA a decode step first gathered every context into a padded copy, and
  SDPA's kernel is built for long query blocks, so one-token decode queries spent far longer in it
  than reading their K/V once takes (docs/design-history.md, Paged attention). Both attention kernels read
  a float32 or a bf16 cache (``--kv-cache-dtype``; widened to float32 before any math,
  ``csrc/kv_elem.h``);
* causal prefill attention (``csrc/prefill_attention.cpp``), for the short, few-headed chunks
  on which SDPA's CPU kernel, built for long sequences and many heads, runs far below the FMA peak;
* small-batch linear layers (``csrc/small_m_linear.cpp``) for decode-sized inputs (at most
  ``SMALL_M_MAX`` rows), where oneDNN's packed GEMM does not overlap reading the weights with
  computing (:mod:`engine_workers.kernels.cpu_linear`);
* fused residual add + RMSNorm and SiLU gating (``csrc/fused_elementwise.cpp``);
* linears with bf16 or weight-only int8 weights and float32 activations (``csrc/small_m_lowp.cpp``,
  ``--dtype bfloat16`` / ``--quantization int8`` on a CPU), bound and checked in
  :mod:`engine_workers.kernels.lowp_kernels`;
* linears on Q4_1/Q8_0 block weights (``csrc/block_linear.cpp``, ``--quantization q4_1``):
  :mod:`engine_workers.kernels.cpu_blocks`; the elementwise passes of int8-activation linears
  (``csrc/int8_act.cpp``, ``--quantization w8a8``): :mod:`engine_workers.kernels.w8a8_linear`.
  bf16 linears on AMX tiles (``csrc/amx_bf16.cpp``, built at the ``amx`` level only):
  :mod:`engine_workers.kernels.amx_linear`.
  Those modules resolve their kernels through :func:`_resolved` and :func:`_checked` here;
  :func:`engine_workers.kernels.readiness.problems` builds and checks them all.

All run on torch's own thread pool and release the GIL; figures in docs/benchmarks.md, design in
docs/design-history.md. CUDA and other dtypes keep torch's ops.

Built with ``torch.utils.cpp_extension`` (g++ and ninja, once; the kernel files include only ATen's
tensor headers, which compile quickly, and only ``module.cpp``, which binds them to Python, pays
for ``torch/extension.h``; build times in docs/design-history.md, Paged attention) into
``$LOCKGATE_CACHE/ext/<ISA level>-<hash of sources, checkout, venv, flags, torch version and CPU>`` (default
cache ``~/.cache/lockgate``), so later processes load it in well under a second; a load also
removes the builds beside it that nothing loaded for 14 days (one per source edit, venv or
checkout). Each kernel is checked against its torch equivalent on random data before use; where
the module cannot be built or a kernel disagrees, the engine logs why and keeps the torch path for
that one.
``--no-cpu-kernels`` / ``LOCKGATE_NO_CPU_KERNELS=1`` turns them all off.

ISA levels (:func:`isa_level`): the module is built for ``amx``, ``avx512`` or ``avx2`` (or ``generic``,
plain loops), the best the CPU's flags allow, chosen and logged once per process; ``LOCKGATE_CPU_ISA``
forces a lower level (docs/design-history.md, "ISA levels").
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine_workers.kernels.isa import (
    ISA_ENV,
    ISA_LEVELS,
    ISA_NEEDS,
    cpu_flags,
    host_isa,
    level_cflags,
    parse_isa,
)

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "module.cpp", CSRC / "paged_decode.cpp", CSRC / "prefill_attention.cpp", CSRC / "small_m_linear.cpp",
           CSRC / "fused_elementwise.cpp", CSRC / "small_m_lowp.cpp", CSRC / "int8_act.cpp", CSRC / "block_linear.cpp",
           CSRC / "int8_gemm.cpp", CSRC / "amx_bf16.cpp"]
HEADERS = [CSRC / "tile.h", CSRC / "kv_elem.h", CSRC / "silu_mul.h", CSRC / "prefill_f16.h", CSRC / "cpu_check.h",
           CSRC / "paged_decode_avx512.h", CSRC / "softmax_row.h", CSRC / "avx2_tile.h"]  # included by the sources: part of the build key, not compiled alone
# Built for one ISA level at a time, chosen at run time (:func:`isa_level`): the best level the
# CPU's flags allow, or a lower one forced by LOCKGATE_CPU_ISA, so the AVX2 code is built, run and
# tested on an AVX-512 host too. Each level is its own module and build directory (the flags are
# in the key) and is built only when a process uses it. -mtune=native only tunes scheduling; the
# cache key includes the CPU anyway, so a build never runs on another model of CPU.
# -fopenmp: at::parallel_for is header code that is serial without it; the library then needs
# libgomp.so.1, which resolves to the copy torch has already loaded (one OpenMP pool, torch's).
# -ffast-math (finite math included) lets GCC vectorise the softmax's expf through glibc's vector
# math library (libmvec); the kernel's scores are finite by construction.
CFLAGS = ["-O3", "-mtune=native", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp", "-lmvec"]
_lock = threading.Lock()
# Per ISA level: "module" and, per kernel key ("decode", "prefill", "small_m", "fused", and the other
# modules' "lowp", "blocks", "w8a8"), the kernel (or None) and "<key>_problem" once resolved; values
# differ by key, and the module has no static type. ``_state`` is the current level's dict
# (rebound by :func:`use_isa`; the other kernel modules read it as ``kernels._state``).
_states: dict[str, dict[str, Any]] = {}
_state: dict[str, Any] = {}
_isa: list[str] = []  # the chosen level once decided (isa_level)
# Per level: (module or None, why not), kept across use_isa switches: loading one extension name
# twice in a process fails.
_modules: dict[str, tuple[Any, str | None]] = {}

T = TypeVar("T")


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
        return model + flags
    except OSError:
        return platform.processor()


STALE_BUILD_S = 14 * 24 * 3600  # a build not loaded for this long is removed (see _prune_stale)


def _build_dir(level: str) -> Path:
    # The source's path and the Python environment are in the key too: the build files name the
    # source by path, so two checkouts (or venvs) sharing one directory would rebuild each other.
    parts = [*(f.read_text() for f in SOURCES + HEADERS), *map(str, SOURCES), sys.prefix, *isa_cflags(level),
             *LDFLAGS, torch.__version__, _cpu_id()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    from tokenization.model_store import cache_dir

    root = cache_dir() / "ext"
    path = root / f"cpu_kernels-{level}-{key}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _prune_stale(current: Path, now: float | None = None) -> list[Path]:
    """Remove the other ``cpu_kernels-*`` builds beside ``current`` that no process has loaded for
    ``STALE_BUILD_S``, and mark ``current`` as just used. Every source edit, venv or checkout gets
    its own build, so without this the cache only grows. A build still in use elsewhere
    (another checkout sharing the cache) is touched by each load, so it stays; one removed by
    mistake is rebuilt on its next use. Returns what was removed; never raises."""
    import shutil
    import time

    now = time.time() if now is None else now
    removed = []
    try:
        os.utime(current)
        for other in current.parent.glob("cpu_kernels-*"):
            if other != current and other.is_dir() and now - other.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(other, ignore_errors=True)
                removed.append(other)
    except OSError as exc:
        log.debug("pruning old kernel builds: %s", exc)
    if removed:
        log.info("removed %d kernel builds unused for %d days", len(removed), STALE_BUILD_S // 86400)
    return removed


def reference_decode(q, k_cache, v_cache, tables, ctx, block_size: int, scale: float) -> torch.Tensor:
    """The same attention through gather + SDPA (the engine's path without the kernel)."""
    from engine_workers.kernels.paged_reference import decode_mask, sdpa_decode

    mask = decode_mask(ctx, tables.shape[1] * block_size, q.dtype)
    return sdpa_decode(q, k_cache, v_cache, tables, mask, block_size, scale)


KV_DTYPES = (torch.float32, torch.bfloat16)  # cache dtypes the attention kernels read (see prefill_close)


def _check(fn: Callable) -> str | None:
    """Compare with :func:`reference_decode` on random data, float32 and bf16 caches, through both
    of the kernel's paths (head size 16: the per-sequence loop; 64: on AVX-512 builds, the split
    path, with a context over two of its 128-token units); ``None`` when they agree."""
    gen = torch.Generator().manual_seed(0)
    for bs, hkv, hq, d, blocks, tables, ctx in (
            (4, 2, 6, 16, 12, [[5, 2, 9], [0, 11, 3], [7, 0, 0]], [10, 12, 1]),
            (16, 2, 6, 64, 24, [list(range(20)), [23, 21, 0, 0] + [0] * 16], [300, 50])):
        kc, vc = torch.randn(blocks * bs, hkv, d, generator=gen), torch.randn(blocks * bs, hkv, d, generator=gen)
        q = torch.randn(len(ctx), hq, d, generator=gen)
        for dt in KV_DTYPES:
            args = (q, kc.to(dt), vc.to(dt), torch.tensor(tables), torch.tensor(ctx), bs, d**-0.5)
            got, want = fn(*args), reference_decode(*args)
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return f"paged decode kernel disagrees with SDPA ({str(dt).removeprefix('torch.')} cache, head size {d})"
    return None


def paged_decode() -> Callable | None:
    """The kernel ``(q, k_cache, v_cache, tables, ctx, block_size, scale) -> out``, or ``None``
    where it is turned off or cannot be built (then :func:`problem` says why). Thread-safe; the
    build happens once per process, later calls return at once."""
    return _resolved("decode", _resolve, "CPU decode attention stays on SDPA")


def paged_decode_loop() -> Callable | None:
    """The decode kernel's one-task-per-sequence loop, taken on every build and head size (the
    split path's peer in the tests and in ``lockgate bench decode``), or ``None`` where
    :func:`paged_decode` is."""
    return _module()[0].paged_decode_loop if paged_decode() is not None else None


def paged_decode_splits(head_size: int) -> bool:
    """Whether :func:`paged_decode` takes its split-K path (csrc/paged_decode_avx512.h) for this
    head size: an AVX-512 build and a head size of 32, 64 or 128."""
    return paged_decode() is not None and bool(_module()[0].paged_decode_splits(head_size))


def problem() -> str | None:
    paged_decode()
    return _state["decode_problem"]


def _resolved(key: str, resolve: Callable[[], tuple[T | None, str | None]], fallback: str) -> T | None:
    """``resolve()`` once per process under the lock; its problem, if any, logged once."""
    with _lock:
        if key not in _state:
            _state[key], _state[key + "_problem"] = resolve()
            if _state[key + "_problem"]:
                log.warning("%s: %s", fallback, _state[key + "_problem"])
            else:
                log.info("CPU kernel loaded: %s", key)
        return _state[key]


def _checked(get: Callable[[Any], T], check: Callable[[T], str | None], what: str) -> tuple[T | None, str | None]:
    """``get(module)`` if the module builds and ``check`` finds nothing, else ``(None, why)``."""
    module, why = _module()
    if module is None:
        return None, why
    obj = get(module)
    try:
        bad = check(obj)
    except RuntimeError as exc:
        bad = f"{what} failed its check: {exc}"
    return (None, bad) if bad else (obj, None)


def prefill_attention() -> Callable | None:
    """The causal prefill kernel ``(q [n, Hq, D], k [ctx, Hkv, D], v, scale) -> [n, Hq, D]``
    (query row i attends keys ``0 .. ctx - n + i``), or ``None`` (then
    :func:`prefill_problem` says why). Thread-safe."""
    return _resolved("prefill", _resolve_prefill, "CPU prefill attention stays on SDPA")


def prefill_problem() -> str | None:
    prefill_attention()
    return _state["prefill_problem"]


def prefill_f16_values() -> bool:
    """Whether the prefill kernel is in use and runs a bf16 cache's Q . K and P . V in float16 (built
    on a CPU with AVX512-FP16; csrc/prefill_attention.cpp, "Float16 pass")."""
    return prefill_attention() is not None and bool(_module()[0].prefill_f16_values())


def reference_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention through SDPA with an explicit offset-causal mask (K/V of either cache
    dtype, widened to q's)."""
    import torch.nn.functional as F

    n, ctx = q.shape[0], k.shape[0]
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
    k, v = k.to(q.dtype), v.to(q.dtype)  # a bf16 cache's K/V, widened: the math is q's dtype
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def prefill_close(got: torch.Tensor, want: torch.Tensor, kv_dtype: torch.dtype) -> bool:
    """Whether the prefill kernel's ``got`` matches :func:`reference_prefill`'s ``want``: within
    float32 rounding for a float32 cache; for a bf16 cache, within the float16 pass's error (Q . K
    and P . V in float16 on CPUs with AVX512-FP16: ~1e-3 relative for scores of order 1, the
    data this check and the tests use; csrc/prefill_attention.cpp, "Float16 pass"), with margin,
    and far inside what a wrong key, block or rescale would give (errors of order 1)."""
    if got.shape != want.shape:
        return False
    if kv_dtype == torch.float32:
        return torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    return rel <= 3e-3 and torch.allclose(got, want, rtol=1e-2, atol=1e-2)


def _check_prefill(fn: Callable) -> str | None:
    """Compare with :func:`reference_prefill`: a fresh chunk and a continuation, GQA, a strided
    query view (as the engine passes it), float32 and bf16 K/V; ``None`` when they agree."""
    gen = torch.Generator().manual_seed(0)
    for n, ctx, hq, hkv, d in ((37, 37, 6, 2, 16), (5, 70, 4, 4, 64), (40, 130, 9, 3, 64)):
        fused = torch.randn(n, (hq + hkv) * d, generator=gen)
        q = fused[:, : hq * d].view(n, hq, d)
        k, v = torch.randn(ctx, hkv, d, generator=gen), torch.randn(ctx, hkv, d, generator=gen)
        for dt in KV_DTYPES:
            got, want = fn(q, k.to(dt), v.to(dt), d**-0.5), reference_prefill(q, k.to(dt), v.to(dt), d**-0.5)
            if not prefill_close(got, want, dt):
                return (f"prefill attention kernel disagrees with SDPA at n={n} ctx={ctx} "
                        f"({str(dt).removeprefix('torch.')} K/V)")
    return None


def _resolve_prefill() -> tuple[Callable | None, str | None]:
    return _checked(lambda m: m.prefill_attention, _check_prefill, "prefill attention kernel")


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The fused elementwise kernels (``csrc/fused_elementwise.cpp``)."""

    add_rms_norm: Callable  # (residual [T, H], delta or None, weight [H], eps) -> out; residual += delta in place
    silu_mul: Callable  # (gate_up [T, 2I]) -> silu(gate) * up [T, I]


def fused() -> FusedOps | None:
    """The fused elementwise kernels, or ``None`` (then :func:`fused_problem` says why)."""
    return _resolved("fused", _resolve_fused, "CPU norms and gating stay on torch ops")


def fused_problem() -> str | None:
    fused()
    return _state["fused_problem"]


def _check_fused(ops: FusedOps) -> str | None:
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    for t, h in ((1, 16), (9, 40), (33, 576)):
        res, delta, w = (torch.randn(t, h, generator=gen) * 3, torch.randn(t, h, generator=gen),
                         torch.randn(h, generator=gen))
        want_res = res + delta
        want = w * (want_res * torch.rsqrt(want_res.pow(2).mean(-1, keepdim=True) + 1e-5))
        got_res = res.clone()
        got = ops.add_rms_norm(got_res, delta, w, 1e-5)
        if not (torch.allclose(got_res, want_res) and torch.allclose(got, want, rtol=1e-4, atol=1e-5)):
            return f"add_rms_norm disagrees with torch at T={t} H={h}"
        gu = torch.randn(t, 2 * h, generator=gen) * 20  # large |x|: the exp clamp matters
        if not torch.allclose(ops.silu_mul(gu), F.silu(gu[:, :h]) * gu[:, h:], rtol=1e-4, atol=1e-4):
            return f"silu_mul disagrees with torch at T={t} I={h}"
    return None


def _resolve_fused() -> tuple[FusedOps | None, str | None]:
    return _checked(lambda m: FusedOps(m.add_rms_norm, m.silu_mul), _check_fused, "fused elementwise kernels")


def small_m() -> tuple[Callable, Callable] | None:
    """``(pack, linear)`` of the small-batch linear kernel, or ``None`` (then
    :func:`small_m_problem` says why): ``pack(weight [N, K]) -> panels`` once per layer,
    ``linear(x [M, K] contiguous, panels, N, bias or None) -> [M, N]``. Thread-safe."""
    return _resolved("small_m", _resolve_small_m, "CPU small-batch linears stay on oneDNN")


def small_m_problem() -> str | None:
    small_m()
    return _state["small_m_problem"]


def _module() -> tuple[Any, str | None]:
    """The built extension module of the current ISA level, or ``(None, why not)``; built once per
    process and level (caller holds ``_lock``)."""
    if os.environ.get("LOCKGATE_NO_CPU_KERNELS", "") not in ("", "0"):  # read on every resolve
        return None, "off (LOCKGATE_NO_CPU_KERNELS)"
    if "module" not in _state:
        level = isa_level()
        if level in _modules:
            _state["module"], _state["module_problem"] = _modules[level]
            return _state["module"], _state["module_problem"]
        try:
            from torch.utils.cpp_extension import load

            build = _build_dir(level)
            # one module name per level, so two levels can be loaded in one process (the tests);
            # load() appends torch's libraries to the ldflags list it is given: a copy, or the next
            # level's build key (which hashes LDFLAGS) would differ from every other process's
            _state["module"] = load(name=f"lockgate_cpu_kernels_{level}", sources=[str(f) for f in SOURCES],
                                    extra_cflags=isa_cflags(level), extra_ldflags=list(LDFLAGS),
                                    build_directory=str(build),
                                    verbose=False)
            _state["module_problem"] = None
            _prune_stale(build)
        except Exception as exc:  # no compiler, no ninja, a failed build: all mean "use torch's"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            _state["module"] = None
            _state["module_problem"] = f"cannot build {CSRC.name}/ for {level}: {type(exc).__name__}: {first}"
        _modules[level] = (_state["module"], _state["module_problem"])
    return _state["module"], _state["module_problem"]


def _resolve() -> tuple[Callable | None, str | None]:
    return _checked(lambda m: m.paged_decode, _check, "paged decode kernel")


def _check_small_m(pack: Callable, linear: Callable) -> str | None:
    """Compare with ``F.linear`` over the tile and panel tails (M not a multiple of 4, N not of 96,
    K not of the k block), with and without bias; ``None`` when they agree."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 96, 64), (7, 100, 70), (13, 200, 130)):
        w, b, x = (torch.randn(n, k, generator=gen), torch.randn(n, generator=gen),
                   torch.randn(m, k, generator=gen))
        panels = pack(w)
        for bias in (None, b):
            got, want = linear(x, panels, n, bias), F.linear(x, w, bias)
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                return f"small-batch linear kernel disagrees with F.linear at M={m} N={n} K={k}"
    return None


def _resolve_small_m() -> tuple[tuple[Callable, Callable] | None, str | None]:
    return _checked(lambda m: (m.pack_small_m, m.small_m_linear), lambda f: _check_small_m(*f),
                    "small-batch linear kernel")


def isa_level() -> str:
    """The ISA level the kernels are built for in this process: ``LOCKGATE_CPU_ISA`` where set
    (checked by :func:`parse_isa`; it may only lower the level), else :func:`host_isa`. Decided
    once and logged once; :func:`use_isa` changes it (tests)."""
    if not _isa:
        forced = os.environ.get(ISA_ENV, "")
        level = parse_isa(forced) if forced else host_isa()
        _isa.append(level)
        if not _states:  # the first level decided owns the dict resolved so far; later ones get
            _states[level] = _state  # their own in use_isa (a setdefault here gave the env's level the current one's)
        log.info("CPU kernels: ISA level %s (%s)", level,
                 f"forced by {ISA_ENV}; the CPU's best is {host_isa()}" if forced else "the best this CPU supports")
    return _isa[0]


def use_isa(level: str | None) -> str:
    """Switch this process's kernels to ``level`` (``None``: back to the environment's or the
    host's choice), checked as :func:`parse_isa`. Each level keeps its own built module and
    resolved kernels, so switching back costs nothing; layers already built keep the kernels they
    were built with. Returns the level now in use."""
    global _state
    with _lock:
        chosen = parse_isa(level) if level is not None else None
        _isa.clear()
        if chosen is not None:
            _isa.append(chosen)
            log.info("CPU kernels: ISA level %s (set in process; CPU best %s)", chosen, host_isa())
        chosen = isa_level()
        _state = _states.setdefault(chosen, {})
        return chosen


def isa_cflags(level: str, flags: set[str] | None = None) -> list[str]:
    """The compiler flags of a ``level`` build on a CPU with ``flags`` (default: this one's)."""
    return [*CFLAGS, *level_cflags(level, cpu_flags() if flags is None else flags)]


def fast_isa_problem(what: str) -> str | None:
    """Why the fast low-precision kernel ``what`` is not worth running at this ISA level (plain
    loops, slower than float32), or ``None`` at ``avx2`` and above."""
    level = isa_level()
    if level in ISA_LEVELS:
        return None
    return (f"this CPU lacks AVX2 + FMA ({', '.join(f for f in ISA_NEEDS['avx2'] if f not in cpu_flags())}) "
            f"that the {what} kernel needs")
