"""Run a test file's Triton checks in a child process under TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when it is imported, and the pytest process may have
imported triton already, so a file's `check(case)` calls run in a child
(`python <file>`, the variable set before any import). The child prints one line,
MARK + JSON {case: None or the failure's traceback}; the parent's fixture returns that
dict and each parametrized test reports its case.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback

import pytest


def run_interpreted(path: str, mark: str) -> dict:
    """The {case: failure or None} results of `python path` under the interpreter."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: pip install 'dropless[triton]'")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, path], env=env, capture_output=True, text=True, timeout=240
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(mark)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"interpreted run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len(mark) :])


def child_main(cases, check, mark: str) -> None:
    """The child's entry: run check(case) for every case, print MARK + the results."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for case in cases:
        try:
            check(case)
            results[case] = None
        except Exception:
            results[case] = traceback.format_exc(limit=6)
    print(mark + json.dumps(results), flush=True)
