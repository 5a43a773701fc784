"""What the docs tell a user to import exists under that name.

Every fenced Python block of README.md and docs/*.md is read for its imports (`import X`,
`import X as Y`, `from X import a, b`) and for every dotted name of ours it writes out
(`dropless.x.y`, or `dh.x` after `import dropless.hf as dh`), comments included; every
inline code span naming `dropless.hf...` (the entry points the prose names, and
`python -m dropless.hf...`) is read too. Each one is imported and resolved, each module
once. A name whose module needs an optional package that is not installed (jax, peft)
is skipped; anything else that does not resolve fails, naming the doc and the name.

`dropless.hf` exports exactly the names the user docs name: no counter or helper of its
submodules sits beside its entry points.
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?:python|py)[ \t]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
OURS = re.compile(r"\bdropless(?:\.[A-Za-z_]\w*)+")
MISSING = object()  # an optional dependency is not installed
# the packages of pyproject.toml's extras: a doc may import one that is not installed here
OPTIONAL = {"jax", "jaxlib", "peft", "transformers", "safetensors", "triton", "tokenizers"}
OPTIONAL |= {"tensorboard", "matplotlib", "pyarrow", "rich", "jinja2"}


def python_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def _chain(node: ast.AST) -> list[str] | None:
    """['dh', 'moe_layers'] for `dh.moe_layers`; None for anything not a name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def block_names(code: str) -> set[str]:
    """The modules a block imports and the dotted names it writes, as full dotted paths
    (`X` for `import X`, `X.a` for `from X import a`, `dropless.hf.f` for `dh.f`)."""
    names = set(OURS.findall(code))  # comments too: `# every dropless.nn.MoE: ...`
    tree = ast.parse(code)
    aliases = {}  # local name -> module of ours it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names.add(a.name)
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    aliases.setdefault(a.name.split(".")[0], a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            chain = _chain(node)
            if chain and aliases.get(chain[0], "").startswith("dropless"):
                names.add(".".join([aliases[chain[0]], *chain[1:]]))
    return names


def inline_hf_names(text: str) -> set[str]:
    """`dropless.hf...` named in inline code spans (calls and `python -m` included)."""
    found = set()
    for span in INLINE.findall(text):
        found.update(n for n in OURS.findall(span) if n.split(".")[:2] == ["dropless", "hf"])
    return found


def _is_optional_missing(err: ModuleNotFoundError) -> bool:
    return bool(err.name) and err.name.split(".")[0] in OPTIONAL


def resolve(dotted: str, cache: dict[str, object]) -> object:
    """The object `dotted` names: the longest importable module prefix, then attributes.
    MISSING when an optional dependency it needs is not installed; raises otherwise."""
    parts = dotted.split(".")
    obj = MISSING
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod not in cache:
            try:
                cache[mod] = importlib.import_module(mod)
            except ModuleNotFoundError as err:
                if _is_optional_missing(err):
                    cache[mod] = MISSING
                elif err.name == mod or (err.name and mod.startswith(err.name + ".")):
                    cache[mod] = None  # not a module: an attribute of its parent
                else:
                    raise
        if cache[mod] is MISSING:
            return MISSING
        if cache[mod] is not None:
            obj = cache[mod]
            for part in parts[i:]:
                obj = getattr(obj, part)
            return obj
    raise ModuleNotFoundError(dotted)


def _doc_names() -> dict[str, set[str]]:
    out = {}
    for doc in DOCS:
        text = doc.read_text()
        names = inline_hf_names(text)
        for block in python_blocks(text):
            names |= block_names(block)
        out[doc.relative_to(REPO).as_posix()] = names
    return out


def test_every_name_the_docs_import_resolves():
    per_doc = _doc_names()
    assert sum(len(v) for v in per_doc.values()) > 40  # the blocks and spans were read
    cache: dict[str, object] = {}
    bad = []
    for doc, names in per_doc.items():
        for name in sorted(names):
            try:
                resolve(name, cache)
            except (ImportError, AttributeError) as err:
                bad.append(f"{doc}: {name} ({type(err).__name__}: {err})")
    assert not bad, "names in the docs that do not resolve:\n" + "\n".join(bad)


def test_dropless_hf_exports_what_the_user_docs_name():
    import dropless.hf as dh

    public = {
        n
        for n, v in vars(dh).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public == set(dh.__all__), "dropless.hf holds names beside __all__"
    user_docs = " ".join(d.read_text() for d in DOCS if d.name != "design.md")
    unnamed = [n for n in dh.__all__ if not re.search(rf"\b{re.escape(n)}\b", user_docs)]
    assert unnamed == [], f"dropless.hf exports names no user doc names: {unnamed}"
    for name in ("CALLS", "PATH_CALLS", "dropless_experts_forward", "is_patched"):
        assert not hasattr(dh, name), name  # internals stay in their modules


def test_the_reader_finds_imports_aliases_and_bad_names(tmp_path):
    code = (
        "import dropless, dropless.hf as dh\n"
        "from dropless.ops import update_expert_bias, nope\n"
        "x = dh.moe_layers(m)   # dropless.nn.MoE\n"
        "dh.gone.attr = 1\n"
    )
    assert block_names(code) == {
        "dropless",
        "dropless.hf",
        "dropless.ops",
        "dropless.ops.update_expert_bias",
        "dropless.ops.nope",
        "dropless.hf.moe_layers",
        "dropless.hf.gone",
        "dropless.nn.MoE",
    }
    text = "run `python -m dropless.hf.x` or `dropless.hf.f(model)`; `dropless.ops.y`\n"
    assert inline_hf_names(text) == {"dropless.hf.x", "dropless.hf.f"}
    assert python_blocks("a\n```python\nimport os\n```\n```toml\nx = 1\n```\n") == ["import os\n"]
    cache: dict[str, object] = {}
    assert resolve("dropless.ops.specs.RoutingConfig", cache).__name__ == "RoutingConfig"
    with pytest.raises(AttributeError):
        resolve("dropless.ops.no_such_name", cache)
    with pytest.raises(ModuleNotFoundError):
        resolve("no_such_package_anywhere.x", cache)
