"""The per-folder time budgets are enforced: pytest writes the time spent per folder
(`--budget-report`, tests/conftest.py) and `.ci/check_budgets.py`, run by `.ci/run`,
fails a folder over 1.5x its budget."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from harness import run_python

ROOT = Path(__file__).resolve().parents[2]


def _conftest():
    """tests/conftest.py by its path (`import conftest` finds whichever folder's came first)."""
    spec = importlib.util.spec_from_file_location("tests_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return conftest


def _checker():
    spec = importlib.util.spec_from_file_location(
        "check_budgets", ROOT / ".ci" / "check_budgets.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pytest_writes_the_time_per_folder_and_its_budget(tmp_path):
    report = tmp_path / "budgets.json"
    test = "tests/bench/test_benchmarks_md.py::test_sections_without_a_command_are_refused"
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", test, "--budget-report", report]
    proc = run_python(args, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    written = json.loads(report.read_text())
    folders = written["folders"]
    assert list(folders) == ["bench"] and folders["bench"]["budget_s"] == 50
    assert 0 <= folders["bench"]["spent_s"] <= written["wall_s"] < 120
    assert written["workers"] == 1


def test_a_folder_over_one_and_a_half_times_its_budget_fails(tmp_path):
    check = _checker()
    ok = {"hf": {"spent_s": 170.0, "budget_s": 120}, "other": {"spent_s": 5.0, "budget_s": None}}
    assert check.over_budget(_report(ok)) == []  # 1.42x: within the tolerance
    bad = ok | {"jax": {"spent_s": 136.0, "budget_s": 90}}
    assert check.over_budget(_report(bad)) == ["jax: 136 s, budget 90 s (x1.5 = 135 s)"]
    report = tmp_path / "r.json"
    report.write_text(json.dumps(_report(bad)))
    proc = run_python([ROOT / ".ci" / "check_budgets.py", report], timeout=30)
    assert proc.returncode == 1 and "OVER BUDGET: jax: 136 s" in proc.stderr
    # the suite's limit is on wall-clock time, not on the folders' sum (2 workers)
    assert check.over_budget(_report(ok, wall_s=599.0)) == []
    assert check.over_budget(_report(ok, wall_s=601.0)) == [
        "the whole suite: 601 s wall-clock, limit 600 s (target 480 s)"
    ]


def _report(folders: dict, wall_s: float = 100.0) -> dict:
    return {"folders": folders, "wall_s": wall_s, "workers": 2}


def test_budgets_add_up_to_less_than_the_suite_limit_on_its_workers():
    """The folders' budgets (test time summed over the workers) fit the suite's wall-clock
    limit on the two workers `scripts/test.sh` starts."""
    check = _checker()
    assert sum(_conftest().BUDGETS.values()) <= 2 * check.SUITE_LIMIT_S


def test_the_suite_runs_in_groups(request):
    """Under `scripts/test.sh` (`-n 2 --dist loadgroup`), pytest-xdist sees our group of
    every test (it appends it to the test's id): a group (a file, a folder's session
    fixtures or interpreted-Triton child) runs on one worker, so its module and session
    fixtures (a spawned process group, a finished tiny run) are built once. pytest 9.2
    ignores xdist 3.8's appended group, and markers set after xdist reads them are not
    seen: either way the id has no group and the tests spread over both workers."""
    if not (hasattr(request.config, "workerinput") and request.config.getvalue("loadgroup")):
        pytest.skip("checks the grouped run of scripts/test.sh (-n 2 --dist loadgroup)")
    assert request.node.nodeid.endswith("@tests/bench/test_ci_budgets.py"), request.node.nodeid
    # a folder's interpreted-Triton child runs once: every test that reads it is in its group
    for item in request.session.items:
        if {"interpreted", "import_check"} & set(item.fixturenames):
            assert item.nodeid.endswith(f"@interpreted:{item.path.parent.name}"), item.nodeid


def test_grouped_ids_count_for_their_folder():
    folder_of, BUDGETS = _conftest().folder_of, _conftest().BUDGETS
    grouped = (
        "tests/parallel/test_parallel.py::test_world2[ep_uniform]@tests/parallel/test_parallel.py"
    )
    assert folder_of(grouped) == "parallel"
    assert folder_of("tests/nn/test_moe.py::test_x@session:tests/train") == "ops+nn"
    assert folder_of("tests/test_cli.py::test_demo_runs@tests/test_cli.py") == "other"
    assert set(BUDGETS) >= {"parallel", "ops+nn", "train", "faults"}
