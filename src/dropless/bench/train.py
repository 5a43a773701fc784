"""`dropless bench train`: the `dropless train` demo config (the default of every key),
run briefly (`--steps`, default 60) in this process, with the run's own summary recorded
as the history line and the section table. `--set KEY=VALUE` overrides any key as
`dropless train` does (e.g. a tiny model for a smoke run)."""

from __future__ import annotations

import argparse
import math
import tempfile

from .common import Recorder, add_history_arguments, require_default_allocator, write_section

# summary keys that are figures (the rest are paths of the run's files)
FIGURES = (
    "steps", "wall_s", "setup_s", "train_s", "cpu_s", "tokens_per_s", "tflops_per_process",
    "mfu", "peak_tflops", "peak_source", "initial_bpb", "final_bpb", "unigram_bpb",
    "final_loss", "final_eval_loss", "peak_memory_mib", "max_mean_load",
)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key as in `dropless train --set` (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--run-dir", default=None, help="keep the run here (default: a temporary directory)"
    )
    add_history_arguments(p, "train")


def run(args) -> int:
    from ..train import load_config, train

    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be >= 1")
    overrides = [*args.overrides, f"train.steps={args.steps}"]  # --steps wins
    cfg = load_config(None, overrides)
    require_default_allocator("train")
    rec = Recorder.start(args)
    with tempfile.TemporaryDirectory(prefix="dropless-bench-train-") as tmp:
        summary = train(cfg, run_dir=args.run_dir or f"{tmp}/run")
    figures = {k: summary.get(k) for k in FIGURES}
    figures["overrides"] = overrides
    figures["tokens_per_step"] = cfg.train.batch_size * cfg.train.seq_len
    record = rec.finish("train", figures)
    text = render(figures)
    print(text)
    write_section(args, rec, "train", record, text)
    return 0


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def render(f: dict) -> str:
    """The table of one `dropless bench train` run's figures (its section's body)."""
    rows = [
        ("steps x tokens per step", f"{f['steps']} x {f['tokens_per_step']:,}"),
        ("wall time (whole run) s", _fmt(f["wall_s"], ".1f")),
        ("setup (data, tokenizer, model) s", _fmt(f["setup_s"], ".1f")),
        ("training s (steps only)", _fmt(f["train_s"], ".1f")),
        ("tokens/s over the training steps", _fmt(f["tokens_per_s"], ",.0f")),
        ("TFLOP/s per process", _fmt(f["tflops_per_process"], ".4f")),
        ("MFU", f"{_fmt(f['mfu'], '.1%')} of {_fmt(f['peak_tflops'], '.3g')} TFLOP/s "
         f"({f['peak_source']})"),
        ("held-out bits per byte, initial -> final",
         f"{_fmt(f['initial_bpb'], '.3f')} -> {_fmt(f['final_bpb'], '.3f')}"),
        ("unigram byte model bits per byte", _fmt(f["unigram_bpb"], ".3f")),
        ("peak memory MiB", _fmt(f["peak_memory_mib"], ",.0f")),
        ("expert load max/mean (last window)", _fmt(f["max_mean_load"], ".2f")),
    ]  # fmt: skip
    lines = ["| figure | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]
    return "\n".join(lines) + "\n"
