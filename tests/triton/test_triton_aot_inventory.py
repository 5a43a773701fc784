"""The ahead-of-time check covers every Triton kernel of the package (fast: no compile).

The `@triton.jit` (and `@triton.autotune`) functions are listed from the source with
`ast`, over every file under src/dropless/ (kernels move between folders: no fixed list),
and compared with what `aot_check` compiles: the kernels its jobs launch plus the jit
device functions they call, followed through imports. A kernel added without a job, or
a job left pointing at a kernel that is gone, fails here with its name; whether the
jobs compile is `test_triton_aot.py`'s (slow) business.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "dropless"
JIT_DECORATORS = ("jit", "autotune")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _is_jit(name: str) -> bool:
    """triton.jit / triton.autotune, or the bare names when imported from triton."""
    head, _, tail = name.rpartition(".")
    return tail in JIT_DECORATORS and head in ("", "triton")


def _imports(tree: ast.Module, module: str, is_pkg: bool) -> dict[str, str]:
    """Local name -> what it names: "pkg.mod" (a module) or "pkg.mod:attr"."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]  # `import a.b` binds a; `import a.b as c`, a.b
                names[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")
                pkg = pkg[: len(pkg) - node.level + (1 if is_pkg else 0)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            for a in node.names:
                names[a.asname or a.name] = f"{base}:{a.name}"
    return names


@functools.cache
def scan(package: Path = PACKAGE) -> tuple[set[str], dict[str, set[str]]]:
    """({"module:function"} of every jit function, {jit function: the jit functions its
    body calls}), from the source alone. Only files that mention triton are parsed (a
    tenth of the package; parsing all of it takes over a second)."""
    jit, calls, imports = set(), {}, {}
    bodies = {}
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        if "triton" not in text:
            continue
        module = _module_name(path)
        tree = ast.parse(text, filename=str(path))
        imports[module] = _imports(tree, module, path.name == "__init__.py")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(_is_jit(_dotted(d)) for d in node.decorator_list):
                    jit.add(f"{module}:{node.name}")
                    bodies[f"{module}:{node.name}"] = (module, node)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                if _is_jit(_dotted(node.value.func)):  # k = triton.jit(fn)
                    for t in node.targets:
                        if isinstance(t, ast.Name):
                            jit.add(f"{module}:{t.id}")

    def resolve(module: str, dotted: str) -> str | None:
        head, _, rest = dotted.partition(".")
        for _ in range(8):  # follow re-exports (a name imported from a module that imports it)
            if not rest and f"{module}:{head}" in jit:
                return f"{module}:{head}"
            target = imports.get(module, {}).get(head)
            if target is None:
                return None
            mod, _, attr = target.partition(":")
            if rest:  # head names a module: `act.glu`, `from . import activations as act`
                mod = f"{mod}.{attr}" if attr else mod
                head, _, rest = rest.partition(".")
            else:
                head = attr
            module = mod
        return None

    for name, (module, node) in bodies.items():
        called = {
            resolve(module, _dotted(c.func)) for c in ast.walk(node) if isinstance(c, ast.Call)
        }
        calls[name] = {c for c in called if c is not None and c != name}
    return jit, calls


def test_scan_finds_the_known_kernels():
    """The scan itself: kernels, device functions, and calls through imports and aliases."""
    jit, calls = scan()
    assert "dropless.ops.grouped_gemm.gemm_kernels:gmm_kernel" in jit
    assert "dropless.ops.quantize.triton_fp8:e4m3_bits" in jit
    assert (
        "dropless.ops.activation.activation_kernels:glu_fwd"
        in calls["dropless.ops.activation.swiglu_quant_kernels:_swiglu_tile"]
    )  # from ..ops.activation.activation_kernels import glu_fwd
    assert (
        "dropless.ops.quantize.triton_fp8:e4m3_bits"
        in calls["dropless.ops.quantize.triton_fp8:e4m3_code"]
    )


def test_aot_check_compiles_every_kernel():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: pip install 'dropless[triton]'")
    from tools.aot_check import planned_kernels

    jit, calls = scan()
    reached, todo = set(), list(planned_kernels())
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(calls.get(name, ()))
    missing, unknown = jit - reached, reached - jit
    device = set().union(*calls.values())  # called by another jit function
    assert not missing and not unknown, (
        "`python -m tools.aot_check` does not compile these @triton.jit "
        "functions; add a job in aot_check._jobs with the launch configuration of each "
        f"kernel's wrapper.\nkernels: {sorted(missing - device)}\ndevice functions (reached "
        f"from no planned kernel): {sorted(missing & device)}\nplanned kernels not found in "
        f"the source: {sorted(unknown)}"
    )


def test_jobs_are_checked_against_the_kernel_signature():
    """A misspelt argument would compile as one more i32 and a missing constexpr fail only
    in the slow compile: `check_job` (run on every job when they are listed) refuses both."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: pip install 'dropless[triton]'")
    from tools import aot_check

    from dropless.ops.grouped_gemm.group_kernels import zero_groups_kernel

    job = aot_check.Job(
        zero_groups_kernel, {"out_ptr": "*bf16", "empty_ptr": "*i8"}, {"BLOCK": 1024}
    )
    aot_check.check_job(job)
    bad = {
        "no argument 'out'": job._replace(types={"out": "*bf16"}),
        "constexpr BLOCK unset": job._replace(consts={}),
        "MN=4096 is not a constexpr": job._replace(consts={"BLOCK": 1024, "MN": 4096}),
    }
    for message, wrong in bad.items():
        with pytest.raises(ValueError, match=message):
            aot_check.check_job(wrong)
