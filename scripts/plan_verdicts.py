#!/usr/bin/env python
"""The rows of docs/parallel.md's table of `dropless plan` verdicts for published models,
computed by `dropless plan --json` at this commit (no weights: `examples/*/config.json`).

    python scripts/plan_verdicts.py            # prints the markdown rows
    python scripts/plan_verdicts.py --only 0,3  # some rows (by index)

Every row's command is `dropless plan` + COMMON + the row's own arguments + `--gpu-memory-gib 80`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

COMMON = ["--set", "train.seq_len=4096", "--set", "train.activation_checkpointing=true"]
QWEN = ["--set", "model.path=examples/qwen3-30b-a3b"]
QWEN_EP8 = [*QWEN, "--set", "train.batch_size=32", "--set", "parallel.ep=8", "--gpus", "8"]
BF16 = ["--set", "model.dtype=bf16", "--set", "optim.master_weights=false"]
NEMO = ["--set", "model.path=examples/nemotron-3-nano-30b-a3b"]
NEMO += ["--set", "train.fused_cross_entropy=false"]
OSS = ["--set", "model.path=examples/gpt-oss-120b", "--set", "model.attn_implementation=eager"]
DSV3 = ["--set", "model.path=examples/deepseek-v3"]

# (model, layout, the row's own arguments)
ROWS = [
    ("Qwen3-30B-A3B", "8 GPUs, ep=8, full, bf16 parameters, no master copy, micro-batch 4",
     [*QWEN_EP8, *BF16]),
    ("Qwen3-30B-A3B", "same, fp32 master copy",
     [*QWEN_EP8, "--set", "model.dtype=bf16", "--set", "optim.master_weights=true"]),
    ("Qwen3-30B-A3B", "same, fp32 parameters (the default)", QWEN_EP8),
    ("Qwen3-30B-A3B", "1 GPU, LoRA (experts and attention, rank 16: the defaults), bf16 base, "
     "micro-batch 4",
     [*QWEN, "--set", "train.batch_size=4", "--set", "finetune.method=lora", "--set",
      "model.dtype=bf16", "--gpus", "1"]),
    ("Qwen3-30B-A3B", "8 GPUs, ep=8, LoRA, bf16 base, micro-batch 4",
     [*QWEN_EP8, "--set", "finetune.method=lora", "--set", "model.dtype=bf16"]),
    ("Qwen3-30B-A3B", "32 GPUs, 131,072 tokens per sequence: cp=8 (each sequence over 8 GPUs) x "
     "dp_shard 4, ep=8, full, bf16 parameters, no master copy, one sequence per cp group",
     [*QWEN, "--set", "train.seq_len=131072", "--set", "parallel.cp=8", "--set", "parallel.ep=8",
      "--set", "train.batch_size=4", *BF16, "--gpus", "32"]),
    ("Nemotron 3 Nano 30B-A3B", "8 GPUs, FSDP2, full, fp32 parameters, micro-batch 4",
     [*NEMO, "--set", "train.batch_size=32", "--gpus", "8"]),
    ("Nemotron 3 Nano 30B-A3B", "16 GPUs, same, micro-batch 2",
     [*NEMO, "--set", "train.batch_size=32", "--gpus", "16"]),
    ("Nemotron 3 Nano 30B-A3B", "8 GPUs, ep=8, full, bf16 parameters (fp32 routers), no master "
     "copy, micro-batch 4",
     [*NEMO, "--set", "train.batch_size=32", "--set", "parallel.ep=8", *BF16, "--gpus", "8"]),
    ("GPT-OSS-120B", "8 GPUs, ep=8, full, bf16 parameters, no master copy, micro-batch 1",
     [*OSS, "--set", "train.batch_size=8", "--set", "parallel.ep=8", *BF16, "--gpus", "8"]),
    ("GPT-OSS-120B", "32 GPUs (4 nodes), same, micro-batch 1",
     [*OSS, "--set", "train.batch_size=32", "--set", "parallel.ep=8", *BF16, "--gpus", "32"]),
    ("DeepSeek-V3 (671B)", "256 GPUs (32 nodes), ep=8, full, fp32 parameters, micro-batch 1",
     [*DSV3, "--set", "train.batch_size=256", "--set", "parallel.ep=8", "--gpus", "256"]),
    ("DeepSeek-V3 (671B)", "512 GPUs, ep=64, same",
     [*DSV3, "--set", "train.batch_size=512", "--set", "parallel.ep=64", "--gpus", "512"]),
]  # fmt: skip


def plan_json(args: list[str]) -> dict:
    """`dropless plan ... --json` in this process: its last JSON line (exit 0 or 1)."""
    from dropless.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", *COMMON, *args, "--gpu-memory-gib", "80", "--json"])
    if rc not in (0, 1):
        raise SystemExit(f"dropless plan {' '.join(args)} exited {rc}")
    return json.loads(out.getvalue().strip().splitlines()[-1])


def row(model: str, layout: str, args: list[str]) -> str:
    p = plan_json(args)
    spare = 80 - p["peak_gib_per_gpu"] - p["reserve_gib"]
    verdict = f"fits ({spare:.0f} GiB to spare)" if p["fits"] else "**does not fit**"
    rate = f"{p['tokens_per_s_per_gpu']:,.0f}"
    needs = f"{p['peak_gib_per_gpu']:.1f} + {p['reserve_gib']:.1f}"
    cmd = " ".join(args)
    return f"| {model} | {layout} | `{cmd}` | {needs} | {verdict} | {rate if p['fits'] else f'({rate})'} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated row indices")
    a = ap.parse_args()
    pick = range(len(ROWS)) if a.only is None else [int(i) for i in a.only.split(",")]
    print(
        "| model | layout | the rest of the command | needs GiB / GPU | verdict | est. tokens/s / GPU |"
    )
    print("|---|---|---|---|---|---|")
    for i in pick:
        print(row(*ROWS[i]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
