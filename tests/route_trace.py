"""The route a piece of code takes through the package's files, traced.

`RouteTrace(package_dir)` records, with `sys.setprofile` on the thread that starts it (the
main thread; other threads are not traced), the first call of each of the package's
functions (module and class bodies are not functions). An **entry** into a file is such a
first call whose nearest caller in the package (the closest frame up the stack whose file is
in the package, skipping torch's and the standard library's frames) is in another file, or
that has no caller in the package. A **re-entry** is an entry into a file already entered.

    trace = RouteTrace(Path(dropless.__file__).parent)
    with trace:
        run_something()
    trace.entries      # [Entry(file, functions first called while there), ...] in order
    trace.re_entries   # how many entries went into a file already entered
    trace.visits       # {file: entries into it}

A function first called from its own file is listed under that file's latest entry.
`trace.stop()` ends the recording from inside the traced code (a hook): the `with` block then
runs on untraced. `trace.start_at(fn)` records nothing until `fn` itself is called.

Used by tests/train/test_route.py (a tiny run from `train()` to the first optimizer step,
and docs/design.md's route written from it by tools/design_route.py) and for the expert
forward's route.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

# a code object's flags: a function's (its own locals); a module or class body has neither
_FUNCTION_FLAGS = 0x1 | 0x2  # CO_OPTIMIZED | CO_NEWLOCALS


@dataclass
class Entry:
    """One entry into a file: the file (relative to the package's parent's parent, e.g.
    `src/dropless/train/trainer.py`) and the functions first called there until the route
    left it (qualified names, in order)."""

    file: str
    functions: list[str] = field(default_factory=list)


class RouteTrace:
    def __init__(self, package_dir: Path, root: Path | None = None):
        self.package = str(Path(package_dir).resolve()) + "/"
        self.root = Path(root or Path(package_dir).resolve().parents[1])
        self.entries: list[Entry] = []
        self.first_calls: list[tuple[str, str]] = []  # (file, function) in order
        self._seen: set = set()
        self._last: dict[str, Entry] = {}  # file -> its latest entry
        self._files: dict[str, str | None] = {}  # co_filename -> package-relative name or None
        self._start_code = None
        self._thread = None
        self.stopped = False

    # -- recording
    def _file(self, filename: str) -> str | None:
        name = self._files.get(filename, "")
        if name == "":
            path = str(Path(filename).resolve())
            name = str(Path(path).relative_to(self.root)) if path.startswith(self.package) else None
            self._files[filename] = name
        return name

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code in self._seen:
            return
        if self._start_code is not None:
            if code is not self._start_code:
                return
            self._start_code = None
        self._seen.add(code)
        file = self._file(code.co_filename)
        if file is None or not code.co_flags & _FUNCTION_FLAGS == _FUNCTION_FLAGS:
            return
        caller, up = None, frame.f_back
        while up is not None and caller is None:
            caller = self._file(up.f_code.co_filename)
            up = up.f_back
        name = getattr(code, "co_qualname", code.co_name)
        self.first_calls.append((file, name))
        if caller != file or file not in self._last:
            self._last[file] = Entry(file)
            self.entries.append(self._last[file])
        self._last[file].functions.append(name)

    def start_at(self, fn) -> RouteTrace:
        """Record nothing until `fn` (a function of the package) is called."""
        self._start_code = fn.__code__
        return self

    def __enter__(self) -> RouteTrace:
        self._thread = threading.get_ident()
        sys.setprofile(self._profile)
        return self

    def stop(self) -> None:
        """End the recording (callable from inside the traced code, on the traced thread)."""
        if threading.get_ident() == self._thread and not self.stopped:
            sys.setprofile(None)
            self.stopped = True

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the counts
    @property
    def visits(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.file] = out.get(e.file, 0) + 1
        return out

    @property
    def re_entries(self) -> int:
        return sum(n - 1 for n in self.visits.values())

    def crossings(self) -> int:
        """Entries whose folder differs from the previous entry's."""
        folders = [str(Path(e.file).parent) for e in self.entries]
        return sum(a != b for a, b in zip(folders, folders[1:]))

    def summary(self) -> dict:
        return {
            "functions": len(self.first_calls),
            "files": len(self.visits),
            "n_entries": len(self.entries),
            "re_entries": self.re_entries,
            "crossings": self.crossings(),
            "most": max(self.visits.values(), default=0),
            "over_3": sorted(f for f, n in self.visits.items() if n > 3),
        }


def trace_run(argv: list[str]) -> RouteTrace:
    """`dropless ARGV` (a `train` command) in this process, traced from the call of
    `dropless.train.trainer.train` to the first optimizer step (a global step pre-hook of
    torch.optim stops the recording; the run then finishes untraced)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import dropless
    from dropless.cli.main import main
    from dropless.train.trainer import train

    trace = RouteTrace(Path(dropless.__file__).parent).start_at(train)
    handle = register_optimizer_step_pre_hook(lambda *a: trace.stop())
    try:
        with trace:
            assert main(argv) == 0
    finally:
        handle.remove()
    return trace


TINY_ARGS = ["train", "examples/tiny.toml"]  # the README's tiny run
# one thread (the expert loop runs its experts on this thread, where the trace sees them), CPU
TRACE_ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}


def trace_in_child(args: list[str], tmp: Path, repo: Path) -> dict:
    """`python tests/route_trace.py` on `dropless ARGS --run-dir TMP/run` in a child (its
    own first calls, whatever this process already ran), from the repository root:
    {"entries": [[file, [functions]], ...], and the counts of `RouteTrace.summary`}."""
    import json

    from harness import run_python

    out = Path(tmp) / "route.json"
    run_python(
        [Path(__file__), out, *args, "--run-dir", Path(tmp) / "run"],
        env=TRACE_ENV, timeout=600, check=True, cwd=repo,
    )  # fmt: skip
    return json.loads(out.read_text())


def outer_names(functions: list[str]) -> list[str]:
    """The functions of an entry as a file defines them: a nested function or a
    comprehension counts as the function that holds it; module-level lambdas are left out."""
    out: list[str] = []
    for f in functions:
        name = f.split(".<locals>", 1)[0]
        if "<" not in name and name not in out:
            out.append(name)
    return out


def render_route(trace: dict) -> str:
    """The numbered route of docs/design.md: one line per entry into a file, with the
    functions first called there."""
    lines = []
    for n, (file, functions) in enumerate(trace["entries"], 1):
        names = outer_names(functions) or ["<lambda>"]
        lines.append(f"{n}. `{file}` — " + ", ".join(f"`{f}`" for f in names))
    return "\n".join(lines) + "\n"


def counts_line(trace: dict) -> str:
    """The counts docs/design.md states above the route."""
    return (
        f"{trace['functions']} functions of the package first called in {trace['files']} files; "
        f"{trace['n_entries']} entries into a file, {trace['re_entries']} of them into a file "
        f"already entered; at most {trace['most']} entries into one file."
    )


BEGIN, END = "<!-- route: begin -->", "<!-- route: end -->"


def design_block(trace: dict) -> str:
    """What docs/design.md holds between its route markers."""
    return f"{BEGIN}\n{counts_line(trace)}\n\n{render_route(trace)}{END}"


def doc_block(text: str) -> str:
    """The route block of a docs/design.md text, markers included."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


if __name__ == "__main__":  # python tests/route_trace.py OUT.json DROPLESS_ARGS...
    import json

    t = trace_run(sys.argv[2:])
    Path(sys.argv[1]).write_text(
        json.dumps({"entries": [[e.file, e.functions] for e in t.entries], **t.summary()})
    )
