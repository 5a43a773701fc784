"""Run the Triton kernel checks in one child process with TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when it is imported, and the pytest process may have
imported triton already, so the checks never run in the pytest process: the first test
that asks for the `interpreted` fixture starts one `python conftest.py FILE...` child
(with the variable set before any import) for every test file of this session that
uses the fixture, and each file's `check(case, "cpu")` runs there for each of its
`CASES`. The child prints one JSON line {file: {case: error text or null}}; the
parametrized tests report each case by name. One child for the folder: importing torch
and triton costs seconds, the interpreter budget is one minute on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARK = "TRITON-CHECKS:"
IMPORT_CHECK = "import dropless without triton"


def _run_child(paths: list[str], timeout: float = 240.0) -> dict[str, dict[str, str | None]]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
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
            f"the interpreted Triton checks failed to run (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len(MARK) :])


def _child_main(paths: list[str]) -> None:
    import traceback

    assert os.environ.get("TRITON_INTERPRET") == "1", "TRITON_INTERPRET=1 must be set first"
    results: dict[str, dict[str, str | None]] = {IMPORT_CHECK: {}}
    # first, in this fresh process, with `import triton` made to fail (as on a machine
    # without it): dropless imports, runs a CPU grouped GEMM (backend "auto"), loads no
    # kernel module, and the kernel functions raise an ImportError naming the extra.
    # Then triton is unblocked for the interpreted checks.
    sys.modules["triton"] = None  # makes `import triton` raise ImportError
    import torch

    import dropless
    import dropless.kernels
    import dropless.ops

    problems = []
    dropless.ops.grouped_gemm(torch.randn(5, 4), torch.randn(2, 3, 4), [2, 3])
    if dropless.kernels.available(torch.randn(1)) or dropless.kernels.triton_importable():
        problems.append("kernels report triton available while it cannot be imported")
    try:
        dropless.kernels.permute  # noqa: B018
        problems.append("dropless.kernels.permute did not raise without triton")
    except ImportError as exc:
        if "dropless[triton]" not in str(exc):
            problems.append(f"the ImportError does not name the extra: {exc}")
    loaded = [m for m in sys.modules if m.startswith("dropless.kernels.")]
    if loaded:
        problems.append(f"CPU use loaded kernel modules {loaded}")
    results[IMPORT_CHECK]["cpu"] = "; ".join(problems) or None
    del sys.modules["triton"]
    dropless.kernels._TRITON_OK = None  # forget the cached answer
    for i, path in enumerate(paths):
        spec = importlib.util.spec_from_file_location(f"_triton_checks_{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        results[path] = {}
        for name, case in module.CASES.items():
            try:
                module.check(case, "cpu")
                results[path][name] = None
            except Exception:
                results[path][name] = traceback.format_exc(limit=6)
    print(MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
else:
    import pytest

    @pytest.fixture(scope="session")
    def interpreted_all(request) -> dict[str, dict[str, str | None]]:
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed: pip install 'dropless[triton]'")
        paths = sorted(
            {
                str(item.path)
                for item in request.session.items
                # only this folder's files: another folder may use a fixture of the same name
                if "interpreted" in item.fixturenames and item.path.parent == HERE
            }
        )
        return _run_child(paths)

    @pytest.fixture
    def interpreted(request, interpreted_all) -> dict[str, str | None]:
        """{case name: None if it passed, else the failure text} for this test file."""
        return interpreted_all[str(request.node.path)]

    @pytest.fixture
    def import_check(interpreted_all) -> str | None:
        """None if, with triton blocked, dropless imported, ran a CPU grouped GEMM, loaded
        no kernel module and named the extra to install; else what went wrong."""
        return interpreted_all[IMPORT_CHECK]["cpu"]
