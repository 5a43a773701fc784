"""The one child-process harness for checks that run under Triton's interpreter on CPU.

Triton reads TRITON_INTERPRET when it is imported, and the pytest process may have
imported triton already, so these checks never run in the pytest process. A test file
that uses the harness defines `CASES` (a dict name -> case, or a list of names) and
`check(case, device)`, and takes its two tests from `interpreted_tests(CASES, check)`:
the CPU test reads the `interpreted` fixture ({case name: None if it passed, else the
failure text}) and reports each case, and the `gpu` test calls `check(case, "cuda")`
compiled on a GPU machine (`pytest -m gpu`). The first test that
asks for the fixture in a folder starts ONE child, `python tests/interpreted.py FILE...`,
for every test file of that folder in the session that uses it (TRITON_INTERPRET=1 and
no CUDA device set before any import): importing torch and triton costs seconds, and a
child per folder puts its time in that folder's budget. The child first checks, with `import triton` made to fail, that dropless
works without triton (the `import_check` fixture), then runs every file's cases and
prints one line, MARK + JSON {file: {case: failure or null}}.

Registered for every folder by `pytest_plugins` in tests/conftest.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

MARK = "INTERPRETED-CHECKS:"
IMPORT_CHECK = "import dropless without triton"
TIMEOUT_S = 600.0


def run_child(paths: list[str], timeout: float = TIMEOUT_S) -> dict[str, dict[str, str | None]]:
    """{file: {case: None or the failure text}} of `paths`, run in one interpreted child."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the interpreter's checks are CPU checks, also on a GPU box
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *paths],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"the interpreted checks failed to run (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len(MARK) :])


def _without_triton() -> str | None:
    """In this fresh process, with `import triton` made to fail (as on a machine without
    it): dropless imports, runs a CPU grouped GEMM (backend "auto"), loads no kernel
    module, and the registered kernel functions raise an ImportError naming the extra.
    None if so, else what went wrong. Triton is unblocked afterwards."""
    sys.modules["triton"] = None  # makes `import triton` raise ImportError
    import torch

    import dropless
    import dropless.ops
    from dropless.ops import registry
    from dropless.ops.permute.row_ops import registered_row_ops

    problems = []
    dropless.ops.grouped_gemm(torch.randn(5, 4), torch.randn(2, 3, 4), [2, 3])
    if registry.cuda_with_triton(torch.randn(1)) or registry.triton_importable():
        problems.append("the registry reports triton available while it cannot be imported")
    try:
        registered_row_ops("triton").gather_rows(torch.randn(3, 4), torch.arange(3))
        problems.append("the triton row ops ran without triton")
    except ImportError as exc:
        if "dropless[triton]" not in str(exc):
            problems.append(f"the ImportError does not name the extra: {exc}")
    loaded = [m for m in sys.modules if m.startswith("dropless.") and m.endswith("_kernels")]
    if loaded:
        problems.append(f"CPU use loaded kernel modules {loaded}")
    del sys.modules["triton"]
    registry.forget_triton()  # forget the cached answer
    return "; ".join(problems) or None


def _run_file(i: int, path: str) -> dict[str, str | None]:
    import traceback

    sys.path.insert(0, str(Path(path).parent))  # the file's own helpers, as pytest sees them
    spec = importlib.util.spec_from_file_location(f"_interpreted_checks_{i}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cases = module.CASES
    out: dict[str, str | None] = {}
    for name in cases:
        try:
            module.check(cases[name] if isinstance(cases, dict) else name, "cpu")
            out[name] = None
        except Exception:
            out[name] = traceback.format_exc(limit=6)
    return out


def _child_main(paths: list[str]) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "TRITON_INTERPRET=1 must be set first"
    results: dict[str, dict[str, str | None]] = {IMPORT_CHECK: {"cpu": _without_triton()}}
    for i, path in enumerate(paths):
        results[path] = _run_file(i, path)
    print(MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
else:
    import pytest

    @pytest.fixture(scope="session")
    def interpreted_children() -> dict[Path, dict[str, dict[str, str | None]]]:
        """The results of each folder's child, filled as its first test asks."""
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed: pip install 'dropless[triton]'")
        return {}

    def _folder_results(request, children) -> dict[str, dict[str, str | None]]:
        # one child per folder, so that each folder's time budget pays for its own checks
        folder = request.node.path.parent
        if folder not in children:
            paths = {
                str(item.path)
                for item in request.session.items
                if "interpreted" in item.fixturenames and item.path.parent == folder
            }
            children[folder] = run_child(sorted(paths))
        return children[folder]

    @pytest.fixture
    def interpreted(request, interpreted_children) -> dict[str, str | None]:
        """{case name: None if it passed, else the failure text} for this test file."""
        return _folder_results(request, interpreted_children)[str(request.node.path)]

    def interpreted_tests(cases, check, *, cuda_cases=None):
        """(test_interpreted, test_cuda) of a Triton test file whose `cases` (a dict name ->
        case, or a list of names) `check(case, device)` checks: `test_interpreted[name]`
        reports the case from the folder's interpreted child, `test_cuda[name]` (marker
        `gpu`) runs `check(case, "cuda")`. `cuda_cases`: the GPU test's cases if not
        `cases` (a list of names in `cases`, or a dict name -> case); empty: no GPU test
        (test_cuda is None). Bind both at module level:
        `test_interpreted, test_cuda = interpreted_tests(CASES, check)`."""

        @pytest.mark.parametrize("name", list(cases))
        def test_interpreted(interpreted, name):
            if interpreted[name] is not None:
                pytest.fail(interpreted[name], pytrace=False)

        on_gpu = cases if cuda_cases is None else cuda_cases
        if not on_gpu:
            return test_interpreted, None
        if not isinstance(on_gpu, dict):
            on_gpu = {n: cases[n] if isinstance(cases, dict) else n for n in on_gpu}

        @pytest.mark.gpu
        @pytest.mark.parametrize("name", list(on_gpu))
        def test_cuda(name):
            check(on_gpu[name], "cuda")

        return test_interpreted, test_cuda

    @pytest.fixture
    def import_check(request, interpreted_children) -> str | None:
        """None if, with triton blocked, dropless imported, ran a CPU grouped GEMM, loaded
        no kernel module and named the extra to install; else what went wrong."""
        return _folder_results(request, interpreted_children)[IMPORT_CHECK]["cpu"]
