"""Serving benchmarks over the whole platform: `lockgate bench serve|e2e|recovery|priority`, the load generator, SLO targets and plots."""
