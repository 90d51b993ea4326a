"""What a request's ``model`` may name at this edge, and what it resolves to (docs/lora.md).

* **Base models**: the edge's ``model`` and each of ``models`` (name -> tokenizer folder). Workers
  of every base model share the bus; a request goes to its model's priority topics. Each model
  has its own :class:`~edge.admission.shedding.LoadShedder` (its workers' heartbeats) and its own
  :class:`~edge.request.PromptEncoder`, loaded on the first request that names the model (a
  model nobody asks for costs nothing). A base model with no live worker is refused at admission
  (503 ``overloaded``, "no live worker for ...") like the edge's own model, never left to hang.
* **Adapters**: a LoRA adapter's name resolves to its base model plus ``lora=<name>``. The
  adapters are the edge's ``--lora-modules`` (of its own model), those loaded through this edge
  at run time (:class:`~edge.admission.loras.RuntimeLoras`: their folder rides on the request),
  and those the live workers of a base model list in their heartbeats (``WorkerStatus.loras``),
  minus names just unloaded here.

Sans-I/O apart from the encoder load (a thread); runs on the edge's event loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from bus import WorkerStatus
from edge.admission.loras import RuntimeLoras
from edge.admission.shedding import LoadShedder
from edge.config import EdgeConfig
from edge.request import PromptEncoder


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request's ``model`` goes: a base model's topics, with an adapter or none."""

    model: str
    lora: str | None = None
    lora_path: str | None = None  # a run-time adapter's folder, for a worker that lacks it


class ModelCatalog:
    def __init__(self, config: EdgeConfig, encoder: PromptEncoder | None) -> None:
        self.config = config
        self.paths: dict[str, str | None] = {config.model: config.model_path, **dict(config.models)}
        self.shedders = {m: LoadShedder(m, config.slo_wait_s, config.max_queue_depth, config.heartbeat_stale_s,
                                        slo_ttft_s=tuple(ms / 1000.0 for ms in config.slo_ttft_ms))
                         for m in self.paths}
        self.encoders: dict[str, PromptEncoder] = {config.model: encoder} if encoder is not None else {}
        self._loading: dict[str, asyncio.Task[PromptEncoder]] = {}
        self.runtime: RuntimeLoras | None = None  # set by the admission once it has a bus

    @property
    def bases(self) -> tuple[str, ...]:
        return tuple(self.paths)

    def observe(self, status: WorkerStatus, now: float) -> None:
        shedder = self.shedders.get(status.model)
        if shedder is not None:
            shedder.observe(status, now)

    def prune(self, now: float) -> None:
        for s in self.shedders.values():
            s.prune(now)

    def live(self, model: str, now: float | None = None) -> list[WorkerStatus]:
        shedder = self.shedders.get(model)
        return shedder.live(time.monotonic() if now is None else now) if shedder is not None else []

    def adapters(self, model: str | None = None) -> list[str]:
        """The adapters of base ``model`` (default: the edge's own), in order: ``--lora-modules``,
        those loaded here at run time, those the live workers list; no repeats, none just unloaded."""
        model = self.config.model if model is None else model
        now = time.monotonic()
        names = list(self.config.lora_modules) if model == self.config.model else []
        rt = self.runtime
        if rt is not None:
            names += [n for n, (m, _) in rt.loaded.items() if m == model]
        listed = [n for s in self.live(model, now) for n in s.loras]
        if rt is not None:
            rt.unmask(model, set(listed), now)
        names += listed
        return [n for n in dict.fromkeys(names) if n not in self.paths and not (rt is not None and rt.masked(n))]

    def resolve(self, name: str | None) -> Target | None:
        """``name`` as a :class:`Target` (None: the edge's own model); None when nothing here has that name."""
        if name is None or name in self.paths:
            return Target(name or self.config.model)
        for model in self.paths:
            if name in self.adapters(model):
                rt = self.runtime
                return Target(model, name, rt.path_of(name) if rt is not None else None)
        return None

    async def encoder_for(self, model: str) -> PromptEncoder:
        """Base ``model``'s tokenizer, loaded (in a thread) on first use; concurrent first uses share one load."""
        enc = self.encoders.get(model)
        if enc is not None:
            return enc
        task = self._loading.get(model)
        if task is None:
            path = self.paths.get(model)
            if path is None:
                raise ValueError(f"no tokenizer folder is configured for model {model!r}")
            task = self._loading[model] = asyncio.ensure_future(asyncio.to_thread(PromptEncoder.from_path, path))
        try:
            enc = await asyncio.shield(task)
        finally:
            if task.done():
                self._loading.pop(model, None)
        self.encoders[model] = enc
        return enc
