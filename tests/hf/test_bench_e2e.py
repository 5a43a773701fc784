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


def _rows(speeds: dict) -> dict:
    """Rows as `table_rows` makes them from each round's tokens/s (no memory)."""
    return {
        key: {"impl": e2e.split_key(key)[0], "optimizer": e2e.split_key(key)[1],
              "tokens_per_s": sorted(v)[len(v) // 2], "step_s": 1.0, "first_loss": 9.0,
              "best_tokens_per_s": max(v), "peak_step_mib": None, "rounds": list(v),
              "round_ids": list(range(len(v)))}
        for key, v in speeds.items()
    }  # fmt: skip


def test_rows_per_optimizer_are_paired_with_the_stock_row_of_the_same_optimizer():
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = p.parse_args(["--impls", "grouped_mm,dropless"])
    assert (args.rounds, args.steps, args.optimizer) == (5, 5, "fused,default")
    keys = e2e._check_args(args)
    assert keys == ["grouped_mm", "dropless", "grouped_mm@default", "dropless@default"]
    # stock with the default AdamW is slower: a ratio against another optimizer's row
    # would read 2x, against its own 1.2x
    rows = _rows({"grouped_mm": [100, 100, 100], "dropless": [140, 150, 130],
                  "grouped_mm@default": [50, 50, 50], "dropless@default": [60, 60, 60]})  # fmt: skip
    rows["grouped_mm"]["peak_step_mib"], rows["dropless"]["peak_step_mib"] = 400.0, 280.0
    figures: dict = {}
    e2e._ratios(figures, rows)
    assert rows["dropless@default"]["vs_grouped_mm"]["median"] == pytest.approx(1.2)
    assert rows["dropless"]["vs_grouped_mm"]["min"] == pytest.approx(1.3)
    assert figures["speedup_vs_grouped_mm"] == pytest.approx(1.4)
    assert figures["memory_vs_grouped_mm"] == pytest.approx(0.7)
    table = e2e._table(rows)
    assert "| HF v5 + `dropless.patch()` | default | 60 (60) |" in table, table
    assert "| 1.40x (1.30-1.50x; best 1.50x) | 0.70x |" in table, table
    summary = e2e._summary(rows, figures)
    assert summary.startswith("AdamW fused: dropless vs stock default (`grouped_mm`): **1.40x")
    assert "AdamW default: dropless vs stock default (`grouped_mm`): **1.20x tokens/s** " in summary
    assert "(median of 3 paired rounds, 1.20-1.20x; best-of-rounds 1.20x)" in summary


def test_the_optimizer_settings_reach_adamw(monkeypatch):
    import torch

    made = []
    real = torch.optim.AdamW

    def spy(params, **kw):
        made.append(kw)
        return real(params, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", spy)
    for opt in ("fused", "default", "foreach"):
        out = e2e.child({"shape": e2e.QUICK, "impl": "dropless", "steps": 1, "optimizer": opt})
        assert out["optimizer"] == opt
    # default: what torch.optim.AdamW(params) picks, neither argument given
    assert made == [{"lr": 1e-4, "fused": True}, {"lr": 1e-4}, {"lr": 1e-4, "foreach": True}]


def test_bad_arguments():
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    with pytest.raises(ValueError, match="--impls"):
        e2e.run(p.parse_args(["--impls", "grouped_mm,fast"]))
    with pytest.raises(ValueError, match="--rounds"):
        e2e.run(p.parse_args(["--rounds", "0"]))
    with pytest.raises(ValueError, match="--eager-rounds 0"):
        e2e.run(p.parse_args(["--eager-rounds", "0"]))
    with pytest.raises(ValueError, match="--optimizer fused,adam"):
        e2e.run(p.parse_args(["--optimizer", "fused,adam"]))


def test_compile_adds_compiled_twins_and_their_paired_ratios():
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = p.parse_args(
        ["--impls", "grouped_mm,eager,dropless", "--compile", "--optimizer", "fused"]
    )
    assert e2e._check_args(args) == [
        "grouped_mm", "eager", "dropless", "grouped_mm+compile", "dropless+compile",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown \['eager\+compile'\]"):
        e2e._check_args(p.parse_args(["--impls", "eager+compile"]))
    rows = _rows({"grouped_mm": [100, 100], "dropless": [130, 130],
                  "grouped_mm+compile": [110, 110], "dropless+compile": [154, 77]})  # fmt: skip
    figures: dict = {}
    e2e._ratios(figures, rows)
    ours = figures["dropless+compile_vs_eager"]
    assert ours["rounds"] == pytest.approx([154 / 130, 77 / 130])  # paired per round
    assert ours["median"] == pytest.approx((154 + 77) / 2 / 130)
    assert ours["best"] == pytest.approx(154 / 130)
    # against stock compiled, in the table too
    assert figures["dropless+compile_vs_grouped_mm+compile"]["rounds"][0] == pytest.approx(1.4)
    assert rows["dropless+compile"]["vs_grouped_mm"]["rounds"][1] == pytest.approx(0.7)
    assert figures["grouped_mm+compile_vs_eager"]["median"] == pytest.approx(1.1)
    assert "grouped_mm+compile_vs_grouped_mm+compile" not in figures
    assert "HF v5 + `dropless.patch()`, `torch.compile`" in e2e._table(rows)
    summary = e2e._summary(rows, figures)
    assert "`dropless+compile` vs stock compiled: 1.05x tokens/s" in summary, summary
    assert "vs its own eager row: 0.89x (0.59-1.18x; best 1.18x)" in summary
