"""Context parallelism in real processes (gloo): one spawned group of 4 runs every check
of `_checks_cp.CHECKS` (cp=4 over all ranks, cp=2 over {0, 1} and {2, 3}); each check
is reported as its own test."""

import pytest
import torch
from _checks_cp import CHECKS

from dropless.parallel import context as cpx
from harness import run_group

_results: dict[str, str] = {}


@pytest.mark.parametrize("check", CHECKS)
def test_cp_world4(check):
    if not _results:
        _results.update(run_group(4, "_checks_cp", CHECKS))
    res = _results[check]
    assert res == "ok", res


def test_shard_round_trip_and_layout():
    """Rank r holds chunks r and 2*cp-1-r; unsharding the ranks' parts gives the input back."""
    x = torch.arange(2 * 24).view(2, 24)
    parts = [cpx.shard_sequence(x, 3, r) for r in range(3)]
    assert parts[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert parts[2][0].tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    assert torch.equal(cpx.unshard_sequence(parts), x)
    b = cpx.shard_batch({"input_ids": x, "labels": x + 1}, 3, 1)
    assert b["position_ids"][1].tolist() == cpx.local_positions(24, 3, 1).tolist()
    assert b["position_ids"][1].tolist() == [4, 5, 6, 7, 16, 17, 18, 19]


def test_seq_len_error_names_the_fix():
    with pytest.raises(
        ValueError, match=r"not divisible by 2 x cp = 4.*multiple of 4, e.g. 8 or 12"
    ):
        cpx.check_seq_len(10, 2)
