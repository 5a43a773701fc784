"""Expert parallelism, FSDP2, HSDP and elastic checkpoints in real processes (gloo).

One group of processes per world size runs every check of `_checks.CHECKS`; each
check is reported as its own test. The world-4 group runs first: it writes the
checkpoint that the world-2 group and the single process below resume from.
"""

import os
import tempfile

import pytest
from _checks import CHECKS

from harness import run_group

_results: dict[int, dict[str, str]] = {}
_tmp = tempfile.TemporaryDirectory(prefix="dropless-parallel-")
os.environ["DROPLESS_PARALLEL_TEST_DIR"] = _tmp.name


def _group(world: int) -> dict[str, str]:
    if world == 2:
        _group(4)  # the world-2 group resumes the world-4 checkpoint
    if world not in _results:
        _results[world] = run_group(world, "_checks", CHECKS[world])
    return _results[world]


@pytest.mark.parametrize("check", CHECKS[4])
def test_world4(check):
    res = _group(4)[check]
    assert res == "ok", res


@pytest.mark.parametrize("check", CHECKS[2])
def test_world2(check):
    res = _group(2)[check]
    assert res == "ok", res


def test_resume_world1_from_world4_checkpoint():
    """A checkpoint saved by 4 processes (ep=4) loads into one plain process."""
    if _group(4)["ckpt_save_w4"] != "ok":
        pytest.fail("the world-4 group did not write its checkpoint")
    from _checks_ckpt import resume_and_compare

    resume_and_compare(1, 1)
