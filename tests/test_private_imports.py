"""No module of ours reaches into another's private names: a name one module uses from
another is public there (no leading underscore). Walks the files under src/dropless and
scripts/ with ast and fails on `from X import _name` and on `X._name` where X is another
module of ours (a module's own names and `__future__` excepted; dunder names such as
`__version__` are public)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(path: Path, src: Path) -> tuple[str, bool]:
    """(dotted name, is a package __init__) of a file under `src`; a script is its stem."""
    try:
        parts = list(path.relative_to(src).with_suffix("").parts)
    except ValueError:
        return path.stem, False
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _resolve(node: ast.ImportFrom, modname: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = modname.split(".") if is_pkg else modname.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _ours(dotted: str) -> bool:
    return dotted == "dropless" or dotted.startswith("dropless.")


def private_uses(path: Path, src: Path = SRC) -> list[str]:
    """'file:line module._name' for every private name of another module of ours that the
    file imports or reads as an attribute of a module it imported."""
    modname, is_pkg = _module_of(path, src)
    tree = ast.parse(path.read_text(), filename=str(path))
    found, aliases = [], {}  # local name -> the module of ours it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "dropless"
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            target = _resolve(node, modname, is_pkg)
            if not _ours(target) or target == modname:
                continue
            for a in node.names:
                if _private(a.name):
                    found.append(f"{node.lineno} {target}.{a.name}")
                else:
                    aliases[a.asname or a.name] = f"{target}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                dotted = ".".join([aliases[base.id], *reversed(chain[1:])])
                if dotted != modname:
                    found.append(f"{node.lineno} {dotted}.{node.attr}")
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return [f"{rel}:{f.split(' ', 1)[0]} {f.split(' ', 1)[1]}" for f in sorted(set(found))]


def _files() -> list[Path]:
    return sorted((SRC / "dropless").rglob("*.py")) + sorted((REPO / "scripts").rglob("*.py"))


def test_no_module_uses_another_modules_private_names():
    files = _files()
    assert len(files) > 80
    bad = [line for path in files for line in private_uses(path)]
    assert not bad, "private names used from another module (make them public there):\n" + (
        "\n".join(bad)
    )


def test_the_walk_sees_planted_private_uses(tmp_path):
    src = tmp_path / "src"
    files = {
        "dropless/__init__.py": "",
        "dropless/a.py": "_x = 1\ny = _x\n",
        "dropless/b.py": (
            "from __future__ import annotations\nfrom .a import _x, y\nfrom . import a\n"
            "import dropless.a as da\nimport dropless\n"
            "print(a._x, da._x, dropless.a._x, a.__name__, y._z)\n"
        ),
        "dropless/c/__init__.py": "from ._impl import f\n",
        "dropless/c/_impl.py": "def f():\n    return _g()\n\n\ndef _g():\n    return 1\n",
    }
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    got = [
        line.split(" ", 1)[1] for p in sorted(src.rglob("*.py")) for line in private_uses(p, src)
    ]
    # b.py: `_x` imported (line 2) and read through three names of module a (line 6, one
    # entry), and `y._z`; a.py's own `_x`, c importing a public name and `_impl`'s own `_g` pass
    assert sorted(got) == ["dropless.a._x", "dropless.a._x", "dropless.a.y._z"], got
