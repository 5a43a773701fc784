"""`dropless bench lora` pieces in-process at the --quick shape (the CLI runs them in children)."""

from __future__ import annotations

import argparse

import pytest

from dropless.bench import e2e, lora

pytest.importorskip("peft")


def test_child_rows_agree_on_the_first_loss_and_train_only_adapters():
    outs = {
        impl: lora.child({"shape": e2e.QUICK, "impl": impl, "steps": 1, "rank": 4})
        for impl in ("peft", "peft_dropless", "full_dropless")
    }
    assert outs["peft_dropless"]["dropless_calls"] >= e2e.QUICK["num_hidden_layers"] * 2
    assert outs["peft_dropless"]["first_loss"] == pytest.approx(
        outs["peft"]["first_loss"], rel=1e-5
    )
    assert outs["peft_dropless"]["trainable"] == outs["peft"]["trainable"]
    assert outs["peft"]["trainable"] < outs["full_dropless"]["trainable"] / 4
    assert all(o["tokens_per_s"] > 0 for o in outs.values())


def test_table_pairs_rounds_against_stock_peft_with_the_same_optimizer_and_bad_arguments():
    row = dict(step_s=2.0, trainable=10, first_loss=9.0, round_ids=[0, 1, 2])
    rows = {
        "peft": {**row, "rounds": [100, 100, 100], "peak_step_mib": 400.0},
        "peft_dropless": {**row, "rounds": [150, 170, 190], "peak_step_mib": 180.0},
        "peft@default": {**row, "rounds": [50, 50, 50], "peak_step_mib": 300.0},
        "peft_dropless@default": {**row, "rounds": [60, 60, 70], "peak_step_mib": 180.0},
    }
    for key, r in rows.items():
        r |= dict(tokens_per_s=sorted(r["rounds"])[1], best_tokens_per_s=max(r["rounds"]))
        r["impl"], r["optimizer"] = e2e.split_key(key)
    e2e.ratios_vs(rows, "peft")
    table = lora._table(rows)
    assert "| 1.70x (1.50-1.90x; best 1.90x) | 0.45x |" in table, table
    assert (
        "| default | 10 | 60 (70) |" in table
        and "| 1.20x (1.20-1.40x; best 1.40x) | 0.60x |" in table
    )
    summary = lora._summary(rows)
    assert summary.startswith("AdamW fused: PEFT + dropless vs stock PEFT: **1.70x tokens/s**")
    assert "AdamW default: PEFT + dropless vs stock PEFT: **1.20x tokens/s**" in summary
    p = argparse.ArgumentParser()
    lora.add_arguments(p)
    with pytest.raises(ValueError, match="--impls"):
        lora.run(p.parse_args(["--impls", "peft,fast"]))
    with pytest.raises(ValueError, match="--rank"):
        lora.run(p.parse_args(["--rank", "0"]))
