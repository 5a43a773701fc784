"""`dropless <command>`: each subcommand lives in its own module under `dropless.cli`
with `add_arguments(parser)` and `run(args) -> int`, imported only when it runs so
`dropless --help` stays fast and optional extras stay optional.
"""

from __future__ import annotations

import argparse
import importlib

from .. import __version__
from .bench import BENCHES
from .messages import is_missing_extra, missing_module_line, one_line_warnings, say_error
from .subcommands import add_subcommands

# command -> (module, one-line help)
COMMANDS = {
    "train": (
        "dropless.cli.train",
        "train or fine-tune a MoE model (no arguments: a CPU demo run)",
    ),
    "plan": (
        "dropless.cli.plan",
        "per-GPU memory and an estimated tokens/s of a layout, before launch",
    ),
    "generate": ("dropless.cli.generate", "sample text from a training run's last checkpoint"),
    "convert": ("dropless.cli.convert", "export a training checkpoint to a Hugging Face directory"),
    "bench": ("dropless.cli.bench", "benchmarks: " + ", ".join(BENCHES)),
    "demo": ("dropless.cli.demo", "run the MoE layer on random data and show what it did"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dropless", description="Dropless Mixture-of-Experts training for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"dropless {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    add_subcommands(parser, COMMANDS, "_module", dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    with one_line_warnings():
        try:
            return int(importlib.import_module(args._module).run(args) or 0)
        except ModuleNotFoundError as e:  # an optional extra that is not installed
            if args.debug or not is_missing_extra(e):
                raise
            say_error(missing_module_line(args.command, e))
            return 2
        except ValueError as e:  # what the user passed (arguments, files, environment, checkout)
            if args.debug:
                raise
            name = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
            say_error(f"dropless {name}: error: {e}")
            return 2


if __name__ == "__main__":
    raise SystemExit(main())
