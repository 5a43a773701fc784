"""An expert-parallel MoE layer makes one host sync per forward+backward (the counts
exchange), in real gloo processes (world 2)."""

import pytest
from _checks_syncs import CHECKS

from harness import run_group

_results: dict[str, str] = {}


@pytest.mark.parametrize("check", CHECKS)
def test_ep_layer_one_host_sync(check):
    if not _results:
        _results.update(run_group(2, "_checks_syncs", CHECKS))
    assert _results[check] == "ok", _results[check]
