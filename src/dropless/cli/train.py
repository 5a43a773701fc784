"""`dropless train [CONFIG.toml] [--set KEY=VALUE ...] [--run-dir DIR] [--resume]`."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", nargs="?", default=None, help="TOML config (default: the built-in CPU demo run)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.steps=100 (repeatable)",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        help="where checkpoints, metrics and plots go (default: runs/<timestamp>)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its last checkpoint",
    )


def run(args) -> int:
    from pathlib import Path

    from ..train import load_config
    from ..train.trainer import train

    config = args.config
    if (
        config is None
        and args.resume
        and args.run_dir
        and (Path(args.run_dir) / "config.toml").is_file()
    ):
        config = str(Path(args.run_dir) / "config.toml")  # a resumed run keeps its config
    try:
        cfg = load_config(config, args.overrides)
        train(cfg, run_dir=args.run_dir, resume=args.resume)
    except ValueError as e:
        print(f"dropless train: error: {e}", file=sys.stderr)
        return 2
    return 0
