"""The worker's intake: the aging priority queue between the bus and the engine (``queue``), fair
share across a tier's tenants (``fair``), and the discrete-event simulations that size them
(``queue_sim``, ``fair_sim``). Pure: no asyncio, no bus, no torch."""
