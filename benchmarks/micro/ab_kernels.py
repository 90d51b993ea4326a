"""A/B one CPU kernel of the engine inside one process (docs/benchmarks.md, "Each change").

    .venv/bin/python -m benchmarks.micro.ab_kernels small_m|prefill|decode|fused [--rounds 4] [--prefill-only]

One engine runs the `lockgate bench engine` workload (32 seeded requests, EOS ignored) over and
over, with the named kernel switched on and off between runs, alternating which goes first, so
the machine's drift hits both sides alike; each run gets a fresh prefix-cache salt. Prints the
sorted run times of each side. ``--prefill-only`` sets every request's max_tokens to 1 (the run is
then the prefill steps alone).
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=("small_m", "prefill", "decode", "fused"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prefill-only", action="store_true")
    a = ap.parse_args()

    from benchmarks.engine.bench import make_workload
    from engine_workers.engine import torch_thread
    from engine_workers.engine.config import EngineConfig
    from engine_workers.engine.core import Engine
    from engine_workers.kernels import cpu_kernels
    from engine_workers.kernels.cpu_linear import PackedLinear
    from engine_workers.model.execution.runner import ModelRunner
    from lockgate_types import SamplingParams

    def run() -> None:
        eng = Engine(EngineConfig(kv_cache_bytes=512 << 20))
        runner = eng.runner
        assert isinstance(runner, ModelRunner), "one process: no --tensor-parallel-size here"
        panels = [(m, m.panels) for m in runner.model.modules() if isinstance(m, PackedLinear)]
        kernels: dict[str, Any] = {"prefill": runner.prefill_kernel, "decode": runner.decode_kernel, "fused": cpu_kernels.fused(),
                   "small_m": any(p is not None for _, p in panels) or None}
        if kernels[a.kernel] is None:
            raise SystemExit(f"the engine did not load the {a.kernel} kernel (see its log)")

        def switch(on: bool) -> None:
            if a.kernel == "small_m":
                for m, p in panels:
                    m.panels = p if on else None
            elif a.kernel == "prefill":
                runner.prefill_kernel = kernels["prefill"] if on else None
            elif a.kernel == "decode":
                runner.decode_kernel = kernels["decode"] if on else None
            else:
                runner.model.use_fused(kernels["fused"] if on else None)

        wl = make_workload(eng.loaded.spec.vocab_size, 32, 0)
        params = [SamplingParams(temperature=0.0, max_tokens=1 if a.prefill_only else m, ignore_eos=True)
                  for m in wl.outputs]
        eng.generate(wl.prompts, params, cache_salt="warm-up")
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(a.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                switch(on)
                t = time.perf_counter()
                eng.generate(wl.prompts, params, cache_salt=uuid.uuid4().hex)
                times[on].append(time.perf_counter() - t)
        switch(True)
        what = "prefill-only workload" if a.prefill_only else "workload"
        print(f"{a.kernel}, {what}, s: with {sorted(round(x, 2) for x in times[True])}  "
              f"without {sorted(round(x, 2) for x in times[False])}")

    torch_thread.call(run)


if __name__ == "__main__":
    main()
