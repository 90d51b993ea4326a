"""The engine's named adapters: which exist, which are loaded, which sit in the model's slots.

Three tiers, as vLLM has them: the adapters named at start (``--lora-modules name=path``, each
read and checked once at start so a bad one fails the start, not a request); a host LRU of at
most ``max_cpu_loras`` loaded adapters (an evicted one is read again from its folder on next use);
and ``max_loras`` slots in the model's layers, the adapters one batch may mix. The scheduler keeps
the running sequences to at most ``max_loras`` distinct adapters
(:class:`~engine_workers.engine.scheduler.SchedulerConfig`), so a step always finds its adapters a
slot: a slot whose adapter the step does not use is reassigned, least recently used first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from engine_workers.model.lora.adapter import LoraAdapter, load_adapter
from engine_workers.model.lora.layers import attach, install
from engine_workers.model.lora.peft_config import LoraError
from engine_workers.model.models.spec import ModelSpec

log = logging.getLogger(__name__)


class LoraManager:
    def __init__(self, model: nn.Module, spec: ModelSpec, modules: Mapping[str, str | Path], *, dtype: torch.dtype,
                 device: torch.device, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None) -> None:
        if max_loras < 1:
            raise LoraError(f"max_loras must be >= 1, got {max_loras}")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise LoraError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.spec, self.dtype, self.device = spec, dtype, device
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras if max_cpu_loras is not None else max_loras
        self.paths = {name: Path(path) for name, path in modules.items()}
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.ranks: dict[str, int] = {}
        # per name, which load it is (bumped by each ``add``): part of the prefix-cache identity, so
        # an adapter removed and added again under its name never meets the old one's KV blocks
        self._generation: dict[str, int] = {}
        self._loads = 0
        for name in self.paths:  # every adapter checked at start; the LRU keeps the last ones read
            self.ranks[name] = self._host_get(name).rank
            self._generation[name] = self._next()
        self.batch, self.layers = attach(model, spec.num_layers, max_loras)
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident adapter -> slot, LRU first
        self.loads = 0  # slot installs since start (a figure for metrics)
        log.info("LoRA: %d adapters (%s), %d slots per batch, rank <= %d, host LRU of %d", len(self.paths),
                 ", ".join(self.paths) or "none", max_loras, max_lora_rank, self.max_cpu_loras)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.paths)

    def identity(self, name: str) -> bytes:
        """Prefix-cache key material of adapter ``name``: its name and folder, so no KV block is
        shared across adapters (nor with the base model, whose key has none)."""
        return f"|lora:{name}@{self.paths[name]}#{self._generation[name]}".encode()

    def _next(self) -> int:
        self._loads += 1
        return self._loads

    def add(self, name: str, path: str | Path) -> None:
        """Load and check a new adapter at run time (:class:`LoraError` naming what is wrong; the
        served set is unchanged then)."""
        if not isinstance(name, str) or not name:
            raise LoraError("a LoRA adapter needs a non-empty name")
        if name in self.paths:
            raise LoraError(f"LoRA adapter {name!r} is already loaded (from {self.paths[name]}); unload it first")
        adapter = load_adapter(name, path, self.spec, self.dtype, self.max_lora_rank)
        self.paths[name], self.ranks[name], self._generation[name] = Path(path), adapter.rank, self._next()
        self._host[name] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def remove(self, name: str) -> None:
        """Forget adapter ``name``: its folder, host copy and slot (the engine refuses while a
        request still uses it)."""
        self.check(name)
        del self.paths[name], self.ranks[name], self._generation[name]
        self._host.pop(name, None)
        slot = self._slots.pop(name, None)
        if slot is not None:
            install(self.layers, slot, None, self.device)

    def check(self, name: str) -> None:
        if name not in self.paths:
            known = ", ".join(self.paths) or "none"
            raise LoraError(f"unknown LoRA adapter {name!r} (this engine serves: {known})")

    def _host_get(self, name: str) -> LoraAdapter:
        adapter = self._host.get(name)
        if adapter is None:
            adapter = load_adapter(name, self.paths[name], self.spec, self.dtype, self.max_lora_rank)
            self._host[name] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(name)
        return adapter

    def prepare(self, loras: Sequence[str | None], lengths: Sequence[int]) -> bool:
        """Set the step's segments: chunk ``i`` has ``lengths[i]`` rows and adapter ``loras[i]``.
        Returns whether any row has an adapter (else the forward is the base model's)."""
        wanted = list(dict.fromkeys(n for n in loras if n is not None))
        if not wanted:
            self.batch.clear()
            return False
        if len(wanted) > self.max_loras:  # the scheduler prevents it; a bug if seen
            raise RuntimeError(f"a batch mixes {len(wanted)} LoRA adapters, above max_loras={self.max_loras}")
        slot_of = {name: self._slot(name, wanted) for name in wanted}
        self.batch.set_runs([(slot_of[name] if name is not None else None, n)
                             for name, n in zip(loras, lengths, strict=True)], self.device)
        return True

    def _slot(self, name: str, wanted: list[str]) -> int:
        slot = self._slots.get(name)
        if slot is None:
            used = set(self._slots.values())
            free = next((s for s in range(self.max_loras) if s not in used), None)
            if free is None:
                victim = next(n for n in self._slots if n not in wanted)  # LRU first
                free = self._slots.pop(victim)
            install(self.layers, free, self._host_get(name), self.device)
            self.loads += 1
            slot = self._slots[name] = free
        self._slots.move_to_end(name)
        return slot

    def done(self) -> None:
        self.batch.clear()
