"""`dropless bench tune`: time the expert engine's row-gathering GEMMs against the grouped
backend at the layer shapes given and write the choice to the tuning cache a run with
`expert_path="gathered"` reads (`dropless.ops.expert_mlp.plan.GemmTuner`). Keys are the
layer's shape only, so every expert-parallel rank reads the same picks. Needs CUDA.

    dropless bench tune --shape 128,8,2048,768 --tokens 8192 --dtype bf16
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..ops.expert_mlp.plan import GemmTuner, plan_expert_mlp
from ..ops.specs import ActivationConfig
from .common import Recorder, add_history_arguments, write_section

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape",
        action="append",
        default=None,
        metavar="E,K,D,F",
        help="a layer shape (repeat for several; default: Qwen3-30B-A3B's 128,8,2048,768)",
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens per layer call (T)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--activation", default="swiglu", help="a gated activation kind")
    p.add_argument("--cache", type=Path, default=None, help="the cache file (default: the run's)")
    p.add_argument("--device", default="cuda")
    add_history_arguments(p, "tuning")


def tune_shapes(shapes, tokens: int, dtype, device, act: ActivationConfig, tuner) -> dict:
    """{shape: the planned GEMMs} after tuning each (E, K, D, F) shape at `tokens` tokens."""
    out = {}
    for E, K, D, F in shapes:
        x = torch.empty(tokens, D, dtype=dtype, device=device)
        gate_up = torch.empty(E, 2 * F, D, dtype=dtype, device=device)
        down = torch.empty(E, D, F, dtype=dtype, device=device)
        plan = plan_expert_mlp(
            x, gate_up, down, act, path="gathered", tokens=tokens * K, tuner=tuner
        )
        if plan.kernels is None:
            raise ValueError(
                f"no row-gathering kernel runs {dtype} on {device} (they need CUDA and triton)"
            )
        out[(E, K, D, F)] = plan.describe()
    return out


def run(args) -> int:
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["128,8,2048,768"])]
    if any(len(s) != 4 for s in shapes):
        raise ValueError(f"--shape takes E,K,D,F; got {args.shape}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("dropless bench tune needs CUDA (the row-gathering kernels run there)")
    rec = Recorder.start(args)
    tuner = GemmTuner(args.cache)
    act = ActivationConfig(args.activation)
    picks = tune_shapes(shapes, args.tokens, DTYPES[args.dtype], args.device, act, tuner)
    lines = [
        f"- E={E} K={K} D={D} F={F} T={args.tokens} {args.dtype}: {gemms}"
        for (E, K, D, F), gemms in picks.items()
    ]
    record = rec.finish("tune", {"picks": lines, "cache": str(tuner.path)})
    text = "\n".join(lines)
    print(text)
    print(f"written: {tuner.path}")
    write_section(args, rec, "tuning", record, text)
    return 0
