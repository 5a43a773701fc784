"""`dropless bench NAME`: each benchmark is a module in `dropless.bench` with
`add_arguments(parser)` and `run(args)`; results append to benchmarks/history.jsonl."""

from __future__ import annotations

import argparse
import importlib

from .main import add_subcommands

BENCHES = {
    "layer": (
        "dropless.bench.layer",
        "one MoE layer fwd+bwd vs the dense bound and Hugging Face v5",
    ),
    "e2e": ("dropless.bench.e2e", "a Qwen3-MoE training step: stock Transformers v5 vs patched"),
    "fp8": ("dropless.bench.fp8", "saved-activation memory (and GPU step time) with FP8/MXFP8"),
    "ep": ("dropless.bench.ep", "expert-parallel layer: time split with/without overlap"),
    "jax": (
        "dropless.bench.jax_bench",
        "the JAX layer vs ragged_dot, capacity einsum, dense bound",
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    add_subcommands(sub, BENCHES, "_bench_module")


def run(args) -> int:
    return int(importlib.import_module(args._bench_module).run(args) or 0)
