"""scripts/bench_step_bound.py: the e2e step's floor is the sum of its parts plus the chosen
AdamW's step, and each ratio is the median of the per-round ratios of step times."""

from __future__ import annotations

import pytest


@pytest.fixture
def bound(load_script):
    return load_script("bench_step_bound")


def _parts(bound, scale: float) -> dict:
    parts = {k: 0.1 * scale for k in bound.PARTS}  # 5 parts: 0.5 s at scale 1
    return parts | {"adamw_fused": 0.05 * scale, "adamw_default": 0.25 * scale}


def test_the_floor_adds_the_parts_and_one_adamw(bound):
    parts = _parts(bound, 1.0)
    assert bound.floor_s(parts, "fused") == pytest.approx(0.55)
    assert bound.floor_s(parts, "default") == pytest.approx(0.75)


def test_ratios_pair_each_round(bound):
    # round 0 runs everything 2x slower: paired ratios ignore it, a ratio of medians would not
    floors = {0: _parts(bound, 2.0), 1: _parts(bound, 1.0), 2: _parts(bound, 1.0)}
    steps = {
        ("grouped_mm", "fused"): {0: 2.2, 1: 1.1, 2: 1.21},  # stock / floor: 2.0, 2.0, 2.2
        ("dropless", "fused"): {0: 1.65, 1: 0.825, 2: 0.88},  # patched / floor: 1.5, 1.5, 1.6
    }
    table = bound._table(floors, steps, ["fused"])
    row = next(line for line in table if line.startswith("| fused |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["0.550", "1.210", "0.880"]  # medians of the rounds' seconds
    assert cells[4] == "2.00x (2.00-2.20x)"
    assert cells[5] == "1.50x (1.50-1.60x)"
    assert cells[6] == "1.33x (1.33-1.38x)"  # stock time / patched time per round
