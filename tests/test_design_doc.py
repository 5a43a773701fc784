"""docs/design.md stays true of the code: its layer table is the layer test's, every path it
names exists, and every function its routes name is defined in the file named beside it.

Paths are written from the repository root (`src/dropless/...`, `tests/...`, `docs/...`).
Reads files only (no import of dropless): well under a second.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "design.md"
ROOTS = ("src/", "tests/", "docs/", "examples/", "scripts/", "benchmarks/", "tools/")
# a step of a route: "12. `path` — `name`..."
ROUTE_STEP = re.compile(r"^\d+\. `(?P<path>[^`]+\.py)` — `(?P<name>[\w.]+)(\(\))?`")


def _layers_test():
    """tests/test_layers.py as a module (its ALLOWED / ALLOWED_MODULES tables)."""
    spec = importlib.util.spec_from_file_location(
        "_design_layers", REPO / "tests" / "test_layers.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ticks(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def layer_table(text: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(package -> packages it may import, package -> single modules it may import) from
    the markdown table whose header starts with `| package |`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| package |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    packages, modules = {}, {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        (name,) = _ticks(cells["package"])
        packages[name] = set(_ticks(cells["may import"]))
        modules[name] = set(_ticks(cells["and these single modules"]))
    return packages, {k: v for k, v in modules.items() if v}


def named_paths(text: str) -> list[str]:
    """Every backticked token that names a file or folder (no spaces; a `/` in it and a
    .py / .md / .json / .toml ending, or a trailing `/`)."""
    return [
        t
        for t in re.findall(r"`([^`\s]+)`", text)
        if "/" in t and (t.endswith("/") or t.rsplit(".", 1)[-1] in ("py", "md", "json", "toml"))
    ]


def defines(path: Path, dotted: str) -> bool:
    """Whether the file exists and defines `name` or `Class.method` (def, class or
    assignment)."""
    if not path.is_file():
        return False
    body = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == part:
                    found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def test_the_layer_table_is_the_layer_tests():
    layers = _layers_test()
    packages, modules = layer_table(DOC.read_text())
    assert packages == layers.ALLOWED
    assert modules == layers.ALLOWED_MODULES


def test_every_named_path_exists_written_from_the_repository_root():
    paths = named_paths(DOC.read_text())
    assert len(paths) > 50  # the routes and the where-to-add lists name files
    short = [p for p in paths if not p.startswith(ROOTS)]
    assert short == [], f"write paths from the repository root: {short}"
    missing = [p for p in paths if not (REPO / p).exists()]
    assert missing == [], f"docs/design.md names paths that do not exist: {missing}"


def test_every_route_step_names_a_function_of_its_file():
    steps = [m for line in DOC.read_text().splitlines() if (m := ROUTE_STEP.match(line))]
    assert len(steps) >= 40  # the training step's route and the expert forward's
    wrong = [f"{m['path']}: {m['name']}" for m in steps if not defines(REPO / m["path"], m["name"])]
    assert wrong == [], f"route steps naming what their file does not define: {wrong}"


def test_the_checks_catch_a_wrong_table_a_missing_path_and_a_moved_function(tmp_path):
    table = (
        "| package | holds | may import | and these single modules |\n|---|---|---|---|\n"
        "| `ops` | x | — | — |\n| `jax` | y | `ops` | `dropless.ops.specs` |\n\nafter\n"
    )
    assert layer_table(table) == (
        {"ops": set(), "jax": {"ops"}},
        {"jax": {"dropless.ops.specs"}},
    )
    assert named_paths("`src/a.py`, `ops/b.py`, `a/b` and `docs/` but `x.py`") == [
        "src/a.py",
        "ops/b.py",
        "docs/",
    ]
    f = tmp_path / "m.py"
    f.write_text("class A:\n    def run(self):\n        pass\n\n\ndef f():\n    pass\n\nX = 1\n")
    assert defines(f, "A.run") and defines(f, "f") and defines(f, "X")
    assert not defines(f, "A.gone") and not defines(f, "g")
    assert not defines(tmp_path / "gone.py", "f")
    assert ROUTE_STEP.match("3. `a.py` — `A.run`, `f`")["name"] == "A.run"
