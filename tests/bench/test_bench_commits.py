"""scripts/bench_commits.py: every (commit, benchmark) in a fresh child each round, the
commits' order rotated, new / old as the median of the per-round ratios."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest


@pytest.fixture
def bench_commits(load_script):
    return load_script("bench_commits")


def test_rounds_rotate_the_commits_and_pair_their_ratios(bench_commits, monkeypatch, capsys):
    calls = []
    # the layer's ms per (commit, round): round 1 slow for both
    ms = {("old", 0): 100.0, ("new", 0): 80.0, ("old", 1): 200.0, ("new", 1): 170.0,
          ("old", 2): 100.0, ("new", 2): 90.0}  # fmt: skip

    def child(src, bench, args):
        calls.append((bench, src.name, args["steps"]))
        r = sum(1 for c in calls if c[:2] == (bench, src.name)) - 1
        return ms[(src.name, r)] if bench == "layer" else 1000.0 / ms[(src.name, r)]

    monkeypatch.setattr(bench_commits, "_child", child)
    rec = argparse.Namespace(sample_load=lambda: calls.append("load"))
    args = argparse.Namespace(rounds=3, steps=5, warmup=1)
    got = bench_commits.measure({"old": Path("old"), "new": Path("new")}, args, rec)
    assert [c[1] for c in calls if c != "load" and c[0] == "layer"] == [
        "old", "new", "new", "old", "old", "new"
    ]  # fmt: skip
    assert calls.count("load") == 2 and all(c[2] == 5 for c in calls if c != "load")
    lines, ratio = bench_commits.table("layer", got["layer"])
    # per round: 100/80, 200/170, 100/90 -> median 1.176; of the medians: 100/90 = 1.11
    assert ratio["median"] == pytest.approx(200 / 170)
    assert ratio["best"] == pytest.approx(100 / 80)
    assert "| old | 100.0, 200.0, 100.0 | 100.0 | 100.0-200.0 |" in lines
    _, e2e = bench_commits.table("e2e", got["e2e"])
    assert e2e["rounds"] == pytest.approx(ratio["rounds"])
