"""What the worker's pipeline stages pass each other, and the one piece of worker state they read.

A stage knows its successor only as a :class:`Stage` (anything with ``put``), given at wiring time:
the stages import none of each other, so the path reads in one place (``worker/wiring.py``) and
runs one way. Pure: no asyncio, no bus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine_workers.worker.offsets.ledger import Job


@dataclass(frozen=True, slots=True)
class Arrival:
    """A held request handed to the next stage.

    ``waited``: it was held by a stage after its fetch (its reply topic's check, its resume lookup,
    a re-run's backoff). A request that did not wait is still inside the intake loop's handling of
    its fetch, which admits once the whole fetch is queued (so the fetch's requests are chosen
    among by priority); one that waited arrives on its own, so the intake admits at once."""

    job: Job
    waited: bool = False


class Stage(Protocol):
    """The successor a stage is handed: takes one :class:`Arrival`, synchronously, never raising
    for a request it cannot serve (it answers, dead-letters or holds it)."""

    def put(self, arrival: Arrival) -> None: ...


class Serving:
    """Whether the worker takes work: set by the actor once started, cleared when it drains or
    stops; read by the stages (a request arriving while it is clear stays uncommitted for the next
    owner). Held here, not on the actor, so that no stage calls back into the actor."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False
