"""A request's one-way path through the worker, one module per stage, in order:

``decode`` (bus record -> :class:`~engine_workers.worker.offsets.ledger.Job`) -> ``gate`` (its
reply topic exists) -> ``resume`` (what another worker already published of it) -> ``checks``
(model, cancel, deadline) -> ``admission`` (the intake queue, then into the engine while it has
room). A request whose replies failed re-enters at ``checks`` (``failures``).

Each stage is handed its successor when the worker is wired (``worker/wiring.py``) and passes it an
:class:`~engine_workers.worker.pipeline.handoff.Arrival`; no stage imports another (a contract in
pyproject.toml), none calls back into the actor or into a stage before it."""
