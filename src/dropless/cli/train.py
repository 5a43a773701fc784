"""`dropless train [CONFIG.toml] [--set KEY=VALUE ...] [--run-dir DIR] [--resume]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from .messages import say_error


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
        help='override a config key, e.g. --set train.steps=100 or --set \'x.y=["a", "b"]\' (repeatable)',
    )
    p.add_argument(
        "--run-dir",
        default=None,
        help="where checkpoints, metrics and plots go (default: a new runs/<timestamp>)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir (default: the newest under ./runs) from its last "
        "complete checkpoint, with the config saved in that checkpoint unless CONFIG is given",
    )


def one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        where = f" ({e.filename})" if e.filename else ""
        return (
            f"{e.strerror}{where}; check free space and permissions of the run directory, then --resume "
            "(the last complete checkpoint is kept)"
        )
    if type(e).__name__ == "CheckpointException":
        failures = getattr(e, "failures", None) or {}
        causes = [f"{type(exc).__name__}: {exc}" for exc, _ in failures.values()]
        first = (causes[0] if causes else str(e)).strip().splitlines()[0]
        return (
            f"the checkpoint could not be read or written ({first[:200]}); check the run directory's disk "
            "and files, or resume from an earlier checkpoints/step_* (dropless --debug train ... shows the traceback)"
        )
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def run(args) -> int:
    from torch.distributed.checkpoint import CheckpointException

    from ..train import trainer
    from ..train.checkpoint import store as ckpt
    from ..train.checkpoint.resume import latest_run, resume_config_file
    from ..train.config.load import load_config
    from ..train.run.errors import TrainingStopped

    try:
        config, run_dir = args.config, args.run_dir
        if args.resume and config is None:  # a resumed run keeps its own config: the copy
            # in the newest checkpoint that verifies (the run directory's own config.toml
            # only for checkpoints older than that copy)
            run_dir = run_dir or str(latest_run())
            config, legacy = resume_config_file(run_dir), Path(run_dir) / "config.toml"
            if config is None and ckpt.list_checkpoints(run_dir) and legacy.is_file():
                config = legacy
        cfg = load_config(config, args.overrides)
        trainer.train(cfg, run_dir=run_dir, resume=args.resume)
    except (TrainingStopped, KeyboardInterrupt, ValueError, OSError, CheckpointException) as e:
        if getattr(args, "debug", False):
            raise
        if isinstance(e, TrainingStopped):
            say_error(f"dropless train: {e}")
            return e.exit_code
        if isinstance(e, KeyboardInterrupt):
            say_error(
                "dropless train: interrupted at once (Ctrl-C outside a step, or a second one); the "
                "steps since the last complete checkpoint are lost; --resume continues from that "
                "checkpoint"
            )
            return 130
        say_error(f"dropless train: error: {one_line(e)}")
        return 2
    return 0
