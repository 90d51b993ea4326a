"""The engine's CPU kernels (C++ sources in ``csrc/``, built on first use), packed linears and
the allocator tuning of a CPU engine."""
