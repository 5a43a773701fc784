"""Fail when a test folder ran over 1.5x its time budget, or the suite over 15 minutes.

python .ci/check_budgets.py REPORT   # REPORT: pytest's --budget-report FILE (tests/conftest.py)
"""

from __future__ import annotations

import json
import sys

TOLERANCE = 1.5  # a shared 2-core CI machine swings by tens of percent between runs
SUITE_BUDGET_S = 15 * 60


def over_budget(folders: dict) -> list[str]:
    """One line per folder over TOLERANCE x its budget (and for the whole suite)."""
    bad = [
        f"{name}: {f['spent_s']:.0f} s, budget {f['budget_s']} s (x{TOLERANCE} = "
        f"{TOLERANCE * f['budget_s']:.0f} s)"
        for name, f in sorted(folders.items())
        if f["budget_s"] is not None and f["spent_s"] > TOLERANCE * f["budget_s"]
    ]
    total = sum(f["spent_s"] for f in folders.values())
    if total > SUITE_BUDGET_S:
        bad.append(f"the whole suite: {total:.0f} s, budget {SUITE_BUDGET_S} s")
    return bad


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        bad = over_budget(json.load(f))
    for line in bad:
        print(f"OVER BUDGET: {line} (BUDGETS in tests/conftest.py)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
