"""`bench/child.py`, the one child-process runner of the benchmarks, on real children."""

from __future__ import annotations

import sys

from dropless.bench.child import run_child_process


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_child_that_ends_gives_its_last_json_line_and_exit_status():
    run = run_child_process(_py("print('warming up'); print('{\"ms\": 1.5}')"), timeout=60)
    assert (run.status, run.returncode, run.last_json()) == ("ok", 0, {"ms": 1.5})
    bad = run_child_process(_py("import sys; sys.stderr.write('boom'); sys.exit(3)"), timeout=60)
    assert (bad.status, bad.returncode, bad.stderr_tail()) == ("fail", 3, "boom")


def test_a_child_past_its_timeout_is_stopped_and_what_it_printed_is_kept():
    code = "import time; print('row 1', flush=True); time.sleep(60)"
    run = run_child_process(_py(code), timeout=1.5)
    assert run.status == "timeout" and run.returncode is None
    assert run.stdout.strip() == "row 1" and "timeout" in run.reason


def test_output_larger_than_a_pipe_does_not_stall_the_child():
    # 1 MiB on each stream: a runner that only polls would leave the child blocked on a
    # full pipe until its timeout
    code = "import sys; sys.stdout.write('x' * 2**20); sys.stderr.write('y' * 2**20)"
    run = run_child_process(_py(code), timeout=60)
    assert run.ok and len(run.stdout) == 2**20 and len(run.stderr) == 2**20


def test_a_child_is_stopped_when_free_memory_falls_under_the_floor():
    run = run_child_process(_py("import time; time.sleep(60)"), timeout=60, min_free_gib=1e9)
    assert run.status == "killed" and "free memory" in run.reason
