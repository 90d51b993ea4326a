"""Where a CUDA engine step's time goes, for ``lockgate bench engine --device cuda``: per forward,
the host's time inside ``ModelRunner.execute`` (building the inputs and issuing the kernels, or
one graph replay) and the device's span of the same forward (CUDA events recorded on the stream at
entry and exit, so a device waiting on the host's launches counts as busy: a span close to the
host time means the step is launch-bound). The rest of a step's wall is the engine's host work
outside the forward (scheduling, sampling, detokenising) and waiting.

Wraps the runner instance's ``execute`` for one run and restores it; CUDA only.
"""

from __future__ import annotations

import time
from collections import Counter

import torch


class StepTimer:
    def __init__(self, runner) -> None:
        self.runner = runner
        self._orig = runner.execute
        self._host: list[float] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        graphs = getattr(runner, "graphs", None)
        self._counts0 = Counter(graphs.counts) if graphs is not None else None

        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            out = self._orig(*args, **kwargs)
            end.record()
            self._host.append(time.perf_counter() - t0)
            self._events.append((start, end))
            return out

        runner.execute = timed

    def close(self, wall_s: float) -> dict:
        """Restore the runner; the run's per-forward figures (ms) given its wall seconds."""
        self.runner.execute = self._orig
        torch.cuda.synchronize()
        n = len(self._host)
        if not n:
            return {"forwards": 0}
        host = sum(self._host) / n * 1e3
        device = sum(a.elapsed_time(b) for a, b in self._events) / n
        wall = wall_s / n * 1e3
        out = {"forwards": n, "wall_ms_per_forward": wall, "forward_host_ms": host, "forward_device_ms": device,
               "outside_forward_ms": max(wall - max(host, device), 0.0)}
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None and self._counts0 is not None:
            out["graph_counts"] = dict(Counter(graphs.counts) - self._counts0)
        return out
