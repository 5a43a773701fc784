"""The subcommand table shared by `dropless <command>` and `dropless bench <name>`: a
module of its own, so `cli/main.py` (which names `cli/bench.py` in its table) and
`cli/bench.py` (which builds its own table the same way) do not import each other.

A subcommand's module is imported, and its arguments added, only when the command line
names that subcommand: `dropless --help` or `dropless bench --help` imports none of them
(the benchmarks import torch and more at module level)."""

from __future__ import annotations

import argparse
import importlib


class _LazySubParsers(argparse._SubParsersAction):
    """Subparsers whose arguments are added when their name is parsed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._modules: dict[str, str] = {}

    def __call__(self, parser, namespace, values, option_string=None):
        module = self._modules.pop(values[0], None)
        if module is not None:
            importlib.import_module(module).add_arguments(self._name_parser_map[values[0]])
        super().__call__(parser, namespace, values, option_string)


def add_subcommands(
    parser: argparse.ArgumentParser, table: dict[str, tuple[str, str]], module_dest: str, **kwargs
) -> None:
    """One subparser per (module, help) entry; `args.<module_dest>` names the module to
    run. kwargs go to `parser.add_subparsers` (dest, metavar, required)."""
    sub = parser.add_subparsers(action=_LazySubParsers, **kwargs)
    for name, (module, help_) in table.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(**{module_dest: module})
        sub._modules[name] = module
