"""LoRA adapters loaded and unloaded at run time, through the bus (docs/lora.md, "At run time").

The edge holds no weights, so ``POST /v1/load_lora_adapter`` becomes one
:class:`~bus.LoraControl` on the control topic, which every worker reads; each worker of the model
loads the adapter and answers a :class:`~bus.LoraAck` on this edge's reply topic (the reply
router hands acks here). The edge waits for the workers it saw live when it sent the control, up
to ``lora_load_timeout_s``:

* no live worker of the model: 503, nothing sent (there is nobody to check the folder);
* any worker refused (a missing folder, a malformed or foreign adapter, LoRA off): 400 naming the
  worker's reason, and the adapter is not registered here (workers that did load it keep it
  until an unload; their heartbeats list it);
* all answered yes, or some did and the others were silent until the timeout: registered.

A registered adapter's requests carry its folder (``InferenceRequest.lora_path``), so a worker
that lacks it (started later, or missed the control) loads it on first use: a request never goes
to the base model instead. An unload is the same round trip; the name is refused at once here
(404 for new requests) and masked in the heartbeats for at least ``UNLOAD_MASK_S`` and until no
live worker lists it (a worker lists it until the requests still using it finish).

Pure state and one coroutine per operation; runs on the edge's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from bus import Bus, ErrorCode, LoraAck, LoraControl, WorkerStatus, encode

log = logging.getLogger(__name__)

UNLOAD_MASK_S = 10.0
MAX_PENDING = 64  # operations waiting for acks at once; more is a 503, not an unbounded wait


@dataclass(frozen=True, slots=True)
class Outcome:
    """An operation's answer: ``code`` None for success, else an edge error code for the HTTP status."""

    message: str
    code: str | None = None


@dataclass(slots=True)
class _Pending:
    expected: set[str]
    acks: dict[str, LoraAck]
    done: asyncio.Event


class RuntimeLoras:
    """The adapters loaded through this edge (name -> (base model, folder)) and the operations in flight."""

    def __init__(self, bus: Bus, control_topic: str, reply_topic: str, edge_id: str, timeout_s: float,
                 live: Callable[[str], list[WorkerStatus]]) -> None:
        self.bus, self.control_topic, self.reply_topic = bus, control_topic, reply_topic
        self.timeout_s = timeout_s
        self.live = live  # the live, non-draining workers of a model
        self.loaded: dict[str, tuple[str, str]] = {}
        # unloaded name -> (its base model, the earliest time heartbeats naming it count again)
        self._masked: dict[str, tuple[str, float]] = {}
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._nonce = f"{edge_id}-{secrets.token_hex(3)}"
        self._lock = asyncio.Lock()  # one operation at a time: a load and an unload of a name never cross

    def masked(self, name: str) -> bool:
        return name in self._masked

    def unmask(self, model: str, listed: set[str], now: float) -> None:
        """Forget the unloads of ``model`` whose floor passed and that none of its live workers
        lists any more (``listed``)."""
        for name in [n for n, (m, until) in self._masked.items() if m == model and now >= until and n not in listed]:
            del self._masked[name]

    def path_of(self, name: str) -> str | None:
        entry = self.loaded.get(name)
        return entry[1] if entry is not None else None

    def on_ack(self, ack: LoraAck) -> None:
        """From the reply router: one worker's answer (late or unknown ones are dropped)."""
        p = self._pending.get(ack.op_id)
        if p is None:
            return
        p.acks[ack.worker_id] = ack
        if p.expected <= p.acks.keys():
            p.done.set()

    async def load(self, model: str, name: str, path: str) -> Outcome:
        async with self._lock:
            if name in self.loaded:
                return Outcome(f"The lora adapter {name!r} has already been loaded (from {self.loaded[name][1]}); "
                               "unload it first", ErrorCode.INVALID_REQUEST)
            out = await self._round_trip(model, "load", name, path)
            if out.code is None:
                self.loaded[name] = (model, path)
                self._masked.pop(name, None)
            return out

    async def unload(self, model: str, name: str) -> Outcome:
        async with self._lock:
            self.loaded.pop(name, None)
            self._masked[name] = (model, time.monotonic() + UNLOAD_MASK_S)  # refused here from now on
            return await self._round_trip(model, "unload", name, None)

    async def _round_trip(self, model: str, action: str, name: str, path: str | None) -> Outcome:
        workers = {s.worker_id for s in self.live(model)}
        if not workers:
            return Outcome(f"no live worker serves {model!r}: nothing to {action} the adapter into", ErrorCode.OVERLOADED)
        if len(self._pending) >= MAX_PENDING:
            return Outcome("too many LoRA operations in flight", ErrorCode.OVERLOADED)
        op = f"{self._nonce}-{next(self._ids):x}"
        pending = self._pending[op] = _Pending(workers, {}, asyncio.Event())
        try:
            msg = LoraControl(op, model, action, name, self.reply_topic, path)
            await self.bus.send(self.control_topic, encode(msg), key=name.encode())
            try:
                async with asyncio.timeout(self.timeout_s):
                    await pending.done.wait()
            except TimeoutError:
                pass
        finally:
            del self._pending[op]
        acks = list(pending.acks.values())
        refused = [a for a in acks if not a.ok]
        if refused:
            a = refused[0]
            return Outcome(f"worker {a.worker_id}: {a.message}", a.code or ErrorCode.INVALID_REQUEST)
        if not acks:
            return Outcome(f"no worker of {model!r} answered the {action} within {self.timeout_s:g} s",
                           ErrorCode.EXPIRED)
        silent = sorted(workers - pending.acks.keys())
        if silent:  # they load it from the request's lora_path on first use
            log.warning("LoRA %s of %r: no answer from %s within %gs", action, name, ", ".join(silent), self.timeout_s)
        verb = "added" if action == "load" else "removed"
        return Outcome(f"Success: LoRA adapter {name!r} {verb} successfully.")
