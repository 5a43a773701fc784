"""Benchmarks behind `dropless bench ...`: layer, e2e, fp8, jax; and `aot_check`, the
ahead-of-time compile of every Triton kernel (`python -m dropless.bench.aot_check`)."""
