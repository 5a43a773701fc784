"""The layer order of docs/design.md, enforced: every import of every module under
src/dropless (module level and inside functions, relative ones resolved, and module
names written as strings for lazy imports) must stay inside this table.

A package may always import itself. `dropless` itself (the package `__init__` and
`__main__`) sits on top: it may import every layer, and only `bench` and `cli` import it.
`jax` imports no module of ours but the torch-free specs module.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from harness import run_python

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "dropless"  # the top-level package's own modules

_BELOW_HF = {"ops", "nn", "quant", "parallel"}
_TRAIN_AND_BELOW = _BELOW_HF | {"hf", "train"}
ALLOWED: dict[str, set[str]] = {
    "ops": set(),
    "nn": {"ops"},
    "quant": {"ops"},
    "parallel": {"ops", "nn", "quant"},
    "hf": _BELOW_HF,
    "train": _BELOW_HF | {"hf"},
    "bench": _TRAIN_AND_BELOW | {"jax", ROOT},
    "cli": _TRAIN_AND_BELOW | {"jax", "bench", ROOT},
    "jax": set(),
    ROOT: _TRAIN_AND_BELOW | {"jax", "bench", "cli"},
}
#: single modules a package may import although their package is not in its row
ALLOWED_MODULES: dict[str, set[str]] = {"jax": {"dropless.ops.specs"}}

_MODULE_STRING = re.compile(r"dropless(\.[A-Za-z_]\w*)+")


def module_name(path: Path, src: Path) -> tuple[str, bool]:
    """(dotted name, is a package __init__) of a source file under `src`."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def _resolve(node: ast.ImportFrom, modname: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = modname.split(".") if is_pkg else modname.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, src: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, wherever it is written."""
    modname, is_pkg = module_name(path, src)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, modname, is_pkg)
            for a in node.names:
                # `from pkg import mod` imports the module pkg.mod when there is one
                sub = f"{target}.{a.name}"
                found.append((node.lineno, sub if _is_module(sub, src) else target))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # importlib.import_module("dropless.x") and lazy-export tables name modules
            if _MODULE_STRING.fullmatch(node.value) and _is_module(node.value, src):
                found.append((node.lineno, node.value))
    return found


def _is_module(dotted: str, src: Path) -> bool:
    p = src.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def package_of(dotted: str) -> str | None:
    """Layer of a module of ours (ROOT for `dropless` itself), None for other packages."""
    parts = dotted.split(".")
    if parts[0] != "dropless":
        return None
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return ROOT
    return parts[1]


def violations(src: Path) -> list[str]:
    """Every import outside the table, as 'file:line: a -> b' lines."""
    bad = []
    for path in sorted((src / "dropless").rglob("*.py")):
        modname, _ = module_name(path, src)
        own = package_of(modname)
        for line, target in imports_of(path, src):
            dest = package_of(target)
            if dest is None or dest == own:
                continue
            if dest in ALLOWED.get(own, set()) or target in ALLOWED_MODULES.get(own, set()):
                continue
            bad.append(f"{path.relative_to(src)}:{line}: {own} -> {target}")
    return bad


def test_every_import_follows_the_layer_order():
    assert (SRC / "dropless" / "ops").is_dir()
    bad = violations(SRC)
    assert not bad, "imports against the layer order (docs/design.md):\n" + "\n".join(bad)


def test_every_package_has_a_row():
    packages = {p.name for p in (SRC / "dropless").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(ALLOWED) - {ROOT}


FAKE = {
    "dropless/__init__.py": "",
    "dropless/ops/__init__.py": "from .dispatch import pick\n",
    "dropless/ops/dispatch.py": (
        "def pick():\n    import dropless.quant  # lazy, still a violation\n    return 1\n"
    ),
    "dropless/ops/specs.py": "import dataclasses\n",
    "dropless/quant/__init__.py": "from ..ops import dispatch\n",
    "dropless/nn/__init__.py": '_LAZY = {"x": "dropless.hf"}\n',
    "dropless/hf/__init__.py": "from ..parallel import mesh\n",
    "dropless/parallel/__init__.py": "",
    "dropless/parallel/mesh.py": "from ..hf import x\n",
    "dropless/jax/__init__.py": "from ..ops.specs import A\nfrom .. import ops\n",
    "dropless/jax/routing.py": "import importlib\nimportlib.import_module('dropless.ops.dispatch')\n",
}


def test_the_checker_catches_planted_violations(tmp_path):
    for rel, text in FAKE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    bad = violations(tmp_path)
    assert sorted(bad) == sorted(
        [
            "dropless/ops/dispatch.py:2: ops -> dropless.quant",
            "dropless/nn/__init__.py:1: nn -> dropless.hf",
            "dropless/parallel/mesh.py:1: parallel -> dropless.hf",
            "dropless/jax/__init__.py:2: jax -> dropless.ops",
            "dropless/jax/routing.py:2: jax -> dropless.ops.dispatch",
        ]
    ), bad


def test_import_dropless_stays_light():
    """`import dropless` (and with it `dropless.ops`) imports no triton and registers no
    GPU backend; CPU calls of every registry leave the GPU entries unregistered."""
    code = (
        "import sys, torch, dropless\n"
        "heavy = ['triton', 'torch._dynamo', 'transformers', 'jax', 'dropless.quant', "
        "'dropless.hf', 'dropless.train']\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "from dropless import ops\n"
        "from dropless.ops.rmsnorm import rms_norm\n"
        "x, ids = torch.randn(6, 8), torch.tensor([[0, 1], [1, 0], [0, 1]])\n"
        "sp = ops.sort_by_expert(ids, 2)\n"
        "y = ops.expert_mlp(x[:3], ids, torch.rand(3, 2), torch.randn(2, 8, 8), torch.randn(2, 8, 4))\n"
        "rms_norm(x, torch.ones(8)), ops.route(x, 2), ops.permute(x[:3], sp)\n"
        "print(ops.gemm_backends(), 'triton' in sys.modules)\n"
    )
    out = run_python(["-c", code], env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, after_cpu_calls = out.stdout.splitlines()
    assert loaded == "[]", f"import dropless loaded {loaded}"
    assert after_cpu_calls == "['grouped_mm', 'loop'] False"


@pytest.mark.parametrize("name", ["dropless.ops.specs"])
def test_the_spec_module_imports_only_the_standard_library(name):
    path = SRC.joinpath(*name.split(".")).with_suffix(".py")
    for _, target in imports_of(path, SRC):
        top = target.split(".")[0]
        assert top in sys.stdlib_module_names or top == "__future__", target


def import_graph(src: Path) -> dict[str, set[str]]:
    """module -> the modules of ours it imports, wherever written (functions,
    `if TYPE_CHECKING:` blocks and module-name strings included)."""
    graph = {}
    for path in sorted((src / "dropless").rglob("*.py")):
        modname, _ = module_name(path, src)
        graph[modname] = {t for _, t in imports_of(path, src) if package_of(t) and t != modname}
    return graph


def loops_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of nodes that reach each other in `graph` (strongly connected components
    with more than one node), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(loops)


def import_loops(src: Path) -> list[list[str]]:
    """Every set of files that import each other in a loop, however lazily."""
    return loops_of(import_graph(src))


TRAIN = "dropless.train"
#: the folders of train/, one concept each (docs/design.md); trainer.py, step.py,
#: evaluation.py, state.py and generate.py sit on top of them
TRAIN_ROOMS = ("config", "data", "model", "checkpoint", "plan", "report", "run")


def room_of(module: str) -> str:
    """What a module of train/ counts as in the room graph: its folder
    (`dropless.train.<room>`) for a file inside one, the file itself on top."""
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[:2] == TRAIN.split(".") and len(parts) > 3 else module


def room_graph(src: Path) -> dict[str, set[str]]:
    """train/'s folders and top files -> the folders and top files of train/ they import."""
    rooms: dict[str, set[str]] = {}
    for module, targets in import_graph(src).items():
        if module != TRAIN and not module.startswith(TRAIN + "."):
            continue
        room = room_of(module)
        edges = rooms.setdefault(room, set())
        edges |= {room_of(t) for t in targets if t.startswith(TRAIN + ".")} - {room}
    return rooms


def test_no_file_imports_another_in_a_loop():
    loops = import_loops(SRC)
    assert not loops, "files that import each other (lazily counts too):\n" + "\n".join(
        " <-> ".join(loop) for loop in loops
    )


def test_the_train_rooms_import_each_other_without_a_loop():
    rooms = room_graph(SRC)
    assert {f"{TRAIN}.{r}" for r in TRAIN_ROOMS} <= set(rooms)
    # every file of train/ is in a room but the route map on top
    top = {r for r in rooms if r.count(".") == 2} - {f"{TRAIN}.{r}" for r in TRAIN_ROOMS}
    assert top == {
        f"{TRAIN}.{m}" for m in ("trainer", "build", "step", "evaluation", "state", "generate")
    }
    loops = loops_of(rooms)
    assert not loops, "train/ folders that import each other:\n" + "\n".join(
        " <-> ".join(loop) for loop in loops
    )


def test_the_room_graph_sees_a_loop_between_folders_that_no_file_loop_shows(tmp_path):
    files = {
        "dropless/__init__.py": "",
        "dropless/train/__init__.py": "",
        "dropless/train/a/__init__.py": "",
        "dropless/train/a/x.py": "from ..b import y\n",
        "dropless/train/a/w.py": "",
        "dropless/train/b/__init__.py": "",
        "dropless/train/b/y.py": "",
        "dropless/train/b/z.py": "def f():\n    from ..a import w\n",
        "dropless/train/top.py": "from .a import x\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert import_loops(tmp_path) == []
    assert room_graph(tmp_path)["dropless.train.top"] == {"dropless.train.a"}
    assert loops_of(room_graph(tmp_path)) == [["dropless.train.a", "dropless.train.b"]]


def test_the_loop_finder_sees_lazy_and_type_checking_imports(tmp_path):
    files = {
        "dropless/__init__.py": "",
        "dropless/ops/__init__.py": "",
        "dropless/ops/a.py": "def f():\n    from . import b\n",
        "dropless/ops/b.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
        ),
        "dropless/ops/c.py": "from .a import f\n",
        "dropless/ops/d.py": "from .a import f\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert import_loops(tmp_path) == [["dropless.ops.a", "dropless.ops.b", "dropless.ops.c"]]


MAX_FUNCTION_LINES = 80


def test_no_function_is_over_80_lines():
    long = []
    for path in sorted((SRC / "dropless").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {lines}")
    assert not long, "functions over 80 lines (split where a name explains a part):\n" + "\n".join(
        long
    )
