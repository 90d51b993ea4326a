"""The Kafka implementation of the bus (aiokafka): the bus and its producer/admin (``bus``), the
consumer (``consumer``), connecting (``connect``), topic metadata (``metadata``), the outage guards
(``outage``) and the bounded partition reader (``reader``). Callers reach it through
``bus.connect("kafka://...")``; importing this package imports aiokafka."""

from bus.kafka.bus import KafkaBus

__all__ = ["KafkaBus"]
