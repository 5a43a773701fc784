"""The ratios every `dropless bench` table reports (common.paired: the median of the
per-round ratios, min-max, best-of-rounds) and the verdict line under a run (not a result
with too few steps or rounds, or under load)."""

from __future__ import annotations

import statistics

import pytest

from dropless.bench import common


def test_the_ratio_is_the_median_of_the_per_round_ratios_not_the_ratio_of_medians():
    # round 1 was slow for both rows (another process), round 3 only for the baseline
    base = {0: 100.0, 1: 50.0, 2: 60.0, 3: 100.0, 4: 100.0}
    row = {0: 120.0, 1: 61.0, 2: 130.0, 3: 118.0, 4: 125.0}
    p = common.paired(row, base)
    assert p["rounds"] == pytest.approx([1.2, 1.22, 130 / 60, 1.18, 1.25])
    assert p["median"] == pytest.approx(1.22)
    of_medians = statistics.median(row.values()) / statistics.median(base.values())
    assert of_medians == pytest.approx(1.2) and of_medians != pytest.approx(p["median"])
    assert (p["min"], p["max"]) == pytest.approx((1.18, 130 / 60))
    assert p["best"] == pytest.approx(130 / 100)  # fastest round over fastest round
    assert common.paired_text(p) == "1.22x (1.18-2.17x; best 1.30x)"


def test_only_rounds_both_rows_ran_are_paired():
    p = common.paired({0: 2.0, 1: 3.0, 2: 9.0}, {1: 1.0, 2: 3.0, 3: 1.0})
    assert p["rounds"] == [3.0, 3.0]
    assert common.paired({0: 1.0}, {1: 1.0}) is None and common.paired_text(None) == "-"


def test_the_order_rotates_so_each_row_goes_first_in_turn():
    names = ["a", "b", "c"]
    assert [common.rotated(names, r)[0] for r in range(4)] == ["a", "b", "c", "a"]
    assert common.rotated(names, 1) == ["b", "c", "a"]


def _sample(busy=()):
    return {"loadavg": [0.5, 0.5, 0.5], "busy_processes": len(busy), "busy": list(busy)}


def test_verdict_names_each_reason_a_run_is_not_a_result():
    quiet = {"before": _sample(), "during": [_sample()], "after": _sample()}
    assert common.verdict(5, 5, quiet).startswith("A result: 5 paired rounds of 5 timed steps")
    short = common.verdict(2, 3, quiet, quick=True)
    assert short.startswith("**Not a result**: a tiny smoke shape")
    assert "2 timed step(s) per child (fewer than 5)" in short and "3 round(s)" in short
    assert common.verdict(5, 5, quiet, dirty=True) == (
        "**Not a result**: uncommitted changes in the measured tree."
    )


def test_a_run_under_load_says_so_in_its_load_line_and_verdict():
    # another process busy between two rounds only: caught by the samples between rounds
    load = {"before": _sample(), "during": [_sample(), _sample(["cc1plus 97%"])],
            "after": _sample()}  # fmt: skip
    assert common.under_load(load) == ["cc1plus"]
    text = common.load_sentence(load)
    assert "0 before, at most 1 between rounds, 0 after." in text
    assert text.endswith("**Under load: not a result** (busy: cc1plus).")
    v = common.verdict(5, 5, load)
    assert v == "**Not a result**: under load: other processes busy (cc1plus)."
    assert "Under load" not in common.load_sentence({"before": _sample(), "after": _sample()})
