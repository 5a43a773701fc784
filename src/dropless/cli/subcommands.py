"""The subcommand table shared by `dropless <command>` and `dropless bench <name>`: a
module of its own, so `cli/main.py` (which names `cli/bench.py` in its table) and
`cli/bench.py` (which builds its own table the same way) do not import each other."""

from __future__ import annotations

import importlib


def add_subcommands(sub, table: dict[str, tuple[str, str]], dest: str) -> None:
    """One subparser per (module, help) entry; `args.<dest>` names the module to run."""
    for name, (module, help_) in table.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(**{dest: module})
        importlib.import_module(module).add_arguments(p)
