"""`dropless bench e2e` pieces in-process at the --quick shape (the CLI runs them in children)."""

from __future__ import annotations

import argparse

import pytest

from dropless.bench import e2e


def test_child_runs_each_implementation_with_the_same_first_loss():
    outs = {
        impl: e2e.child({"shape": e2e.QUICK, "impl": impl, "steps": 1, "mode": "time"})
        for impl in ("grouped_mm", "dropless", "dropless-fused-ce")
    }
    assert outs["dropless"]["dropless_calls"] >= e2e.QUICK["num_hidden_layers"] * 2  # 2 steps
    assert outs["grouped_mm"]["dropless_calls"] is None
    for impl in ("dropless", "dropless-fused-ce"):
        assert outs[impl]["first_loss"] == pytest.approx(outs["grouped_mm"]["first_loss"], rel=1e-5)
    assert all(o["tokens_per_s"] > 0 for o in outs.values())


def test_table_and_bad_arguments():
    rows = {
        "grouped_mm": {
            "tokens_per_s": 100.0,
            "step_s": 2.0,
            "peak_step_mib": 400.0,
            "first_loss": 9.0,
        },
        "dropless": {
            "tokens_per_s": 130.0,
            "step_s": 1.5,
            "peak_step_mib": 280.0,
            "first_loss": 9.0,
        },
    }
    table = e2e._table(rows)
    assert "| 1.30x (1.30x) | 0.70x |" in table, table and "`grouped_mm` (default)" in table
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    with pytest.raises(ValueError, match="--impls"):
        e2e.run(p.parse_args(["--impls", "grouped_mm,fast"]))
    with pytest.raises(ValueError, match="--rounds"):
        e2e.run(p.parse_args(["--rounds", "0"]))
    with pytest.raises(ValueError, match="--eager-rounds 0"):
        e2e.run(p.parse_args(["--eager-rounds", "0"]))


def test_compile_adds_compiled_twins_and_their_ratios():
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = p.parse_args(["--impls", "grouped_mm,eager,dropless", "--compile", "--checkpointing"])
    assert e2e._check_args(args) == [
        "grouped_mm", "eager", "dropless", "grouped_mm+compile", "dropless+compile",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown \['eager\+compile'\]"):
        e2e._check_args(p.parse_args(["--impls", "eager+compile"]))
    rows = {
        impl: {"tokens_per_s": tps, "step_s": 1.0, "best_tokens_per_s": tps, "first_loss": 9.0,
               "peak_step_mib": None, "rounds": [tps, tps * r2]}
        for impl, tps, r2 in (("grouped_mm", 100.0, 1.0), ("dropless", 130.0, 1.0),
                              ("grouped_mm+compile", 110.0, 1.0), ("dropless+compile", 154.0, 0.5))
    }  # fmt: skip
    figures: dict = {}
    e2e._ratios(figures, rows)
    ours = figures["dropless+compile_vs_eager"]
    assert ours["of_medians"] == pytest.approx(154 / 130)
    assert ours["rounds"] == pytest.approx([154 / 130, 77 / 130])  # paired per round
    assert ours["median_paired"] == pytest.approx((154 + 77) / 2 / 130)
    assert figures["dropless+compile_vs_grouped_mm+compile"]["rounds"][0] == pytest.approx(1.4)
    assert figures["grouped_mm+compile_vs_eager"]["median_paired"] == pytest.approx(1.1)
    assert "grouped_mm+compile_vs_grouped_mm+compile" not in figures
    assert "HF v5 + `dropless.patch()`, `torch.compile`" in e2e._table(rows)
