"""The composition root: the ``lockgate`` CLI and ``serve``, the only code that wires the edge,
the worker and the bus together. No product package imports it."""
