"""Under expert parallelism the expert engine's tuned GEMM choice is the same on every
rank, though each rank receives different rows: real gloo processes (world 2)."""

import pytest
from _checks_tuning import CHECKS

from harness import run_group

_results: dict[str, str] = {}


@pytest.mark.parametrize("check", CHECKS)
def test_ep_ranks_pick_the_same_gemms(check):
    if not _results:
        _results.update(run_group(2, "_checks_tuning", CHECKS))
    assert _results[check] == "ok", _results[check]
