"""Test doubles shared by the tests and the benchmarks: the tiny random Llama and the fake worker.
Not product code: no product package imports them."""
