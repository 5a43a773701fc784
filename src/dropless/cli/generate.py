"""`dropless generate RUN_DIR --prompt TEXT [--max-new-tokens N]`: Transformers' `generate`
(KV cache) on the run's model, on the dropless experts path."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dir",
        help="a training run directory (its last checkpoint is used) or a checkpoints/step_* directory",
    )
    p.add_argument("--prompt", default="", help="text to continue (default: start from nothing)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument(
        "--top-k", type=int, default=40, help="sample among the k most likely tokens (0: all)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the most likely tokens holding this probability mass (1: all)",
    )
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from ..train.generate import load_run, sample

    cfg, tok, model, ck = load_run(args.run_dir)
    text = sample(
        model,
        tok,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        context=cfg.train.seq_len,
        seed=args.seed,
    )
    print(f"# {ck}", file=sys.stderr)
    print(args.prompt + text)
    return 0
