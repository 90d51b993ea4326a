"""Run-time LoRA loads and unloads on this worker: a :class:`~bus.LoraControl` from the control
topic (the edge's ``POST /v1/load_lora_adapter`` / ``unload_lora_adapter``, docs/lora.md) is run
on the engine and answered with one :class:`~bus.LoraAck` on the control's ``reply_to``.

A load reads and checks the adapter on the torch thread, between two engine steps (the adapter
tensors change the model's slots, which a running step reads); the heartbeat lists it from then
on (``WorkerStatus.loras`` is the engine's adapter names). An unload refuses new requests for the
adapter at once and removes it when the requests still using it finish (``Engine.remove_lora``,
``when_idle``), so a request in flight never changes adapter mid-stream.

Controls for another model are ignored (every worker of every model reads the control topic).
Runs on the event loop; called by the control reader (``loops.read_cancels``), one at a time.
"""

from __future__ import annotations

import asyncio
import logging

from bus import Bus, BusError, ErrorCode, LoraAck, LoraControl, encode
from engine_workers.engine import torch_thread
from engine_workers.engine.core import Engine

log = logging.getLogger(__name__)

ACK_TIMEOUT_S = 5.0  # a broker outage must not hold the control reader (cancels wait behind it)


class LoraControls:
    def __init__(self, engine: Engine, bus: Bus, model: str, worker_id: str) -> None:
        self.engine, self.bus, self.model, self.worker_id = engine, bus, model, worker_id

    def _run(self, msg: LoraControl) -> str:
        """On the torch thread: the load or unload; returns what happened (raises ``ValueError``)."""
        if msg.action == "load":
            assert msg.lora_path is not None  # LoraControl checks it
            self.engine.add_lora(msg.lora_name, msg.lora_path)
            return f"LoRA adapter {msg.lora_name!r} loaded from {msg.lora_path}"
        users = self.engine.remove_lora(msg.lora_name, when_idle=True)
        later = f"; removed once its {users} running request(s) finish" if users else ""
        return f"LoRA adapter {msg.lora_name!r} unloaded{later}"

    async def handle(self, msg: LoraControl) -> None:
        if msg.model != self.model:
            return
        try:
            done = await asyncio.wrap_future(torch_thread.post(self._run, msg))
            ack = LoraAck(msg.op_id, self.worker_id, True, message=done)
            log.info("worker %s: %s", self.worker_id, done)
        except ValueError as exc:  # LoraError included: a missing folder, a bad config, LoRA off
            ack = LoraAck(msg.op_id, self.worker_id, False, ErrorCode.INVALID_REQUEST, str(exc))
            log.warning("worker %s: %s of LoRA adapter %r refused: %s", self.worker_id, msg.action,
                        msg.lora_name, exc)
        except Exception as exc:
            log.exception("worker %s: %s of LoRA adapter %r failed", self.worker_id, msg.action, msg.lora_name)
            ack = LoraAck(msg.op_id, self.worker_id, False, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        try:
            async with asyncio.timeout(ACK_TIMEOUT_S):
                await self.bus.send(msg.reply_to, encode(ack), key=msg.op_id.encode())
        except (BusError, TimeoutError) as exc:  # the edge times out and says which worker did not answer
            log.warning("worker %s: LoRA ack %s to %s not sent (%s)", self.worker_id, msg.op_id, msg.reply_to, exc)
