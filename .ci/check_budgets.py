"""Fail when a test folder ran over 1.5x its time budget, or the suite's wall-clock time
over 10 minutes (its target is 8, plus a margin; the figure is printed on every run).

python .ci/check_budgets.py REPORT   # REPORT: pytest's --budget-report FILE (tests/conftest.py)

A folder's time is its tests' time summed over the xdist workers; the suite's is the
wall-clock time of the whole pytest run.
"""

from __future__ import annotations

import json
import sys

TOLERANCE = 1.5  # a shared 2-core CI machine swings by tens of percent between runs
SUITE_TARGET_S = 8 * 60  # the README's test command on a 2-core machine, wall-clock
SUITE_LIMIT_S = 10 * 60  # over this the run fails (fresh-clone runs measured 388 s and 427 s)


def over_budget(report: dict) -> list[str]:
    """One line per folder over TOLERANCE x its budget (and for the whole suite)."""
    bad = [
        f"{name}: {f['spent_s']:.0f} s, budget {f['budget_s']} s (x{TOLERANCE} = "
        f"{TOLERANCE * f['budget_s']:.0f} s)"
        for name, f in sorted(report["folders"].items())
        if f["budget_s"] is not None and f["spent_s"] > TOLERANCE * f["budget_s"]
    ]
    if report["wall_s"] > SUITE_LIMIT_S:
        bad.append(
            f"the whole suite: {report['wall_s']:.0f} s wall-clock, limit {SUITE_LIMIT_S} s "
            f"(target {SUITE_TARGET_S} s)"
        )
    return bad


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        report = json.load(f)
    for line in over_budget(report):
        print(f"OVER BUDGET: {line} (BUDGETS in tests/conftest.py)", file=sys.stderr)
    print(
        f"the suite: {report['wall_s']:.0f} s wall-clock on {report['workers']} worker(s) "
        f"(target {SUITE_TARGET_S} s, limit {SUITE_LIMIT_S} s)"
    )
    return 1 if over_budget(report) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
