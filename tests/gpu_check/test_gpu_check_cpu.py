"""`scripts/gpu_check.py --cpu` runs (a subset of its groups, in their child processes),
so the script CI cannot run on a GPU never rots."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
SMOKE = ["gemm_layouts", "fused_mlp", "fp8", "expert_parallel"]


def _run(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    last = proc.stdout.strip().splitlines()[-1]
    return proc, json.loads(last)["gpu_check"]


def test_cpu_subset_passes_and_ends_with_the_json_summary():
    proc, summary = _run("--cpu", "--only", ",".join(SMOKE), "--budget", "100")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["ok"] and summary["mode"] == "cpu" and summary["failed"] == []
    assert list(summary["groups"]) == SMOKE
    for name in SMOKE:
        group = summary["groups"][name]
        assert group["status"] == "ok", (name, group)
        ran = [c for c in group["checks"] if c["status"] == "ok"]
        assert ran, name
        for c in ran:  # every numeric check reports its error under its tolerance
            assert c["err"] is None or c["err"] <= c["tol"], c


def test_budget_skips_what_does_not_fit_and_says_so():
    proc, summary = _run("--cpu", "--only", "jax,timing", "--budget", "0", timeout=30)
    assert proc.returncode == 0
    assert summary["groups"]["jax"]["status"] == "skipped"
    assert "budget" in summary["groups"]["jax"]["reason"]
    assert "GPU only" in summary["groups"]["timing"]["reason"]


def test_unknown_group_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "nope"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and "unknown group" in proc.stderr
