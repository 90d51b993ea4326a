"""Benchmarks and load generators behind ``lockgate bench ...``. Not product code: they may cross
layers, and no product package imports them."""
