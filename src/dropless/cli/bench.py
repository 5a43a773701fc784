"""`dropless bench NAME`: each benchmark is a module in `dropless.bench` with
`add_arguments(parser)` and `run(args)`. A run writes no file unless asked: with
`--record`, run from a checkout, it appends one line to the checkout's
benchmarks/history.jsonl and rewrites its section in benchmarks/sections/."""

from __future__ import annotations

import argparse
import importlib

from .subcommands import add_subcommands

BENCHES = {
    "layer": (
        "dropless.bench.layer",
        "one MoE layer fwd+bwd vs the dense bound and Hugging Face v5",
    ),
    "e2e": ("dropless.bench.e2e", "a Qwen3-MoE training step: stock Transformers v5 vs patched"),
    "lora": (
        "dropless.bench.lora",
        "a LoRA fine-tuning step: stock PEFT vs PEFT + dropless.patch(), full fine-tuning",
    ),
    "memory": (
        "dropless.bench.memory",
        "peak step memory per token at long sequences: stock vs the long-sequence recipe",
    ),
    "fp8": ("dropless.bench.fp8", "saved-activation memory (and GPU step time) with FP8/MXFP8"),
    "ep": ("dropless.bench.ep", "expert-parallel layer: time split with/without overlap"),
    "tune": (
        "dropless.bench.tune",
        "tune the expert engine's row-gathering GEMMs and write the cache a run reads",
    ),
    "train": ("dropless.bench.train", "the default `dropless train` config, briefly: its summary"),
    "jax": (
        "dropless.bench.jax_bench",
        "the JAX layer vs ragged_dot, capacity einsum, dense bound",
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_subcommands(p, BENCHES, "_bench_module", dest="bench", metavar="NAME", required=True)


def run(args) -> int:
    return int(importlib.import_module(args._bench_module).run(args) or 0)
