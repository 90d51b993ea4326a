"""The worker seen from outside: the probe/scrape HTTP server (``server``), its Prometheus metrics
(``metrics``) and per-tenant usage and billing (``usage``)."""
