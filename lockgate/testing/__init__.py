"""Test doubles and dev tools shared by the tests, the benchmarks and `lockgate kafka`: the tiny random
Llama, the fake worker, and the local Kafka launcher (``kafka_local``). Not product code: no product
package imports them."""
