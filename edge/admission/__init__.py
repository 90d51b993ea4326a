"""Admission: who may ask (keys, tiers, weights), how fast (rate limits), whether now (load shedding),
and where it goes (prefix affinity). :mod:`edge.admission.gate` turns an admitted
:class:`~edge.request.Generate` into a bus request. Knows neither front end (WebSocket, OpenAI)."""
