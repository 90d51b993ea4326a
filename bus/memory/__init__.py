"""The in-memory implementation of the bus, with Kafka's semantics: the bus and its consumers
(``bus``), the in-process broker (``broker``) and its per-partition log (``log``)."""

from bus.memory.bus import MemoryBroker, MemoryBus, forget_named, named_broker

__all__ = ["MemoryBroker", "MemoryBus", "forget_named", "named_broker"]
