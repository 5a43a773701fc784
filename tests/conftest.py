"""Shared test setup: markers (gpu skipped without CUDA), seeds, thread count, the
groups that spread the suite over pytest-xdist workers, and the time per folder."""

import json
import os
import sys
import time

import pytest
import torch

# the checkout's root: its `tools` package (the GPU check, the ahead-of-time kernel compile)
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the `interpreted` and `import_check` fixtures: one child process under Triton's interpreter
pytest_plugins = ["interpreted"]

# torch threads per process: the cores shared by the pytest-xdist workers. More threads
# than cores makes every parallel op wait at its barrier for a thread another process
# holds (an fp64 gradcheck of a tiny MoE: 1.4 s on one thread, 22 s on two beside a busy
# core). Tests of the threaded paths set their own count.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the group markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(worker_group(item)))
    # the folders with the largest budgets first (a stable sort: a file's order is kept):
    # their long groups (process groups, a finished tiny run) start early, while the other
    # worker works through the short ones, instead of one of them running alone at the end
    items.sort(key=lambda item: -BUDGETS.get(folder_of(item.nodeid), 0))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker, not `item.keywords` (which also holds the names of parent folders)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


def worker_group(item) -> str:
    """The pytest-xdist group of a test (`scripts/test.sh` runs `--dist loadgroup`): every
    group runs on one worker. A fixture is built once per worker that asks for it, so the
    tests that share an expensive one run together: those of a folder's session fixtures (a
    finished tiny run and what is built from it), and those of a folder's interpreted-Triton
    child; any other test goes with its file (its module fixtures)."""
    if {"interpreted", "import_check"} & set(item.fixturenames):  # one child per folder
        return f"interpreted:{item.path.parent.name}"
    shared = sorted(
        {
            defs[-1].baseid  # the conftest's folder: its session fixtures build on each other
            for defs in item._fixtureinfo.name2fixturedefs.values()
            if defs[-1].scope == "session" and defs[-1].baseid  # ours: defined in a conftest
        }
    )
    return "session:" + ",".join(shared) if shared else item.nodeid.split("::")[0]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _stock_transformers_after_each_test():
    """A test that calls `dropless.patch()` or `patch_model()` leaves stock Transformers
    behind it: the tests a worker runs next, from any folder, start unpatched (`unpatch()` is
    a no-op when nothing is patched)."""
    yield
    patching = sys.modules.get("dropless.hf.patching.patch")
    if patching is not None:
        patching.unpatch()


# Per-folder time budgets (seconds of test time on 2 cores, summed over the workers),
# reported at the end of every run;
# `--budget-report FILE` also writes them with the time spent as JSON, which .ci/run
# checks (a folder over 1.5x its budget fails CI); together they fit the suite's 10-minute
# wall-clock limit on two workers.
BUDGETS = {
    "ops+nn": 25,
    "triton": 75,  # one interpreted-Triton child per folder
    "hf": 130,  # target 120; 142-167 s in the suite (~60% of it the compile checks, exports)
    "parallel": 330,  # gloo process groups of 2 and 4 processes, torchrun runs
    "quant": 55,
    "train": 245,  # ~35 s of it: the plan calibration on two gloo processes
    "faults": 155,  # the checkpoint-integrity, run-lock and run-file fault tests
    "jax": 120,
    "gpu_check": 15,  # its --cpu smoke is opt-in (DROPLESS_SLOW_TESTS=1)
    "bench": 50,
}
_spent: dict[str, float] = {}


def folder_of(nodeid: str) -> str:
    """The budget folder of a test id (tests/ops and tests/nn share one)."""
    parts = nodeid.split("::")[0].split("/")  # the file's path (xdist appends "@group" to the id)
    name = parts[1] if len(parts) > 2 else "other"
    return "ops+nn" if name in ("ops", "nn") else name


def pytest_addoption(parser):
    parser.addoption(
        "--budget-report", metavar="FILE", default=None,
        help="write {folder: {spent_s, budget_s}} as JSON at the end (read by .ci/run)",
    )  # fmt: skip


def pytest_sessionstart(session):
    session.config._dropless_start = time.perf_counter()


def pytest_runtest_logreport(report):
    _spent[folder_of(report.nodeid)] = _spent.get(folder_of(report.nodeid), 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if hasattr(terminalreporter.config, "workerinput"):
        return  # an xdist worker: the controller, which sees every report, writes the summary
    terminalreporter.section("time per folder vs budget (BUDGETS in tests/conftest.py)")
    for name, spent in sorted(_spent.items()):
        budget = BUDGETS.get(name)
        flag = "" if budget is None or spent <= budget else "  OVER BUDGET"
        terminalreporter.write_line(
            f"{name:10s} {spent:7.1f} s" + (f" / {budget} s{flag}" if budget else "")
        )
    config = terminalreporter.config
    wall_s = time.perf_counter() - config._dropless_start
    workers = getattr(config.option, "numprocesses", None) or 1
    terminalreporter.write_line(f"the suite: {wall_s:.1f} s wall-clock on {workers} worker(s)")
    report = config.getoption("--budget-report")
    if report:
        folders = {
            n: {"spent_s": round(t, 1), "budget_s": BUDGETS.get(n)} for n, t in _spent.items()
        }
        with open(report, "w") as f:
            json.dump({"folders": folders, "wall_s": round(wall_s, 1), "workers": workers}, f)
