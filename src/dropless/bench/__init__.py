"""Benchmarks behind `dropless bench ...`: layer, e2e, fp8, jax. Not part of the tests."""
