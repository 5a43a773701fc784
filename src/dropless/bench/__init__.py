"""Benchmarks behind `dropless bench ...`: layer, e2e, lora, memory, fp8, ep, train, jax.
The checkout's development tools (the GPU check, the ahead-of-time kernel compile) are in
`tools/`, outside the package."""
