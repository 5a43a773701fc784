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


def test_table_and_bad_arguments():
    row = dict(
        tokens_per_s=100.0, best_tokens_per_s=110.0, step_s=2.0, trainable=10, first_loss=9.0
    )
    rows = {
        "peft": {**row, "peak_step_mib": 400.0},
        "peft_dropless": {**row, "tokens_per_s": 170.0, "peak_step_mib": 180.0},
    }
    table = lora._table(rows)
    assert "| 1.70x | 0.45x |" in table, table
    assert "1.70x tokens/s" in lora._summary(rows)
    p = argparse.ArgumentParser()
    lora.add_arguments(p)
    with pytest.raises(ValueError, match="--impls"):
        lora.run(p.parse_args(["--impls", "peft,fast"]))
    with pytest.raises(ValueError, match="--rank"):
        lora.run(p.parse_args(["--rank", "0"]))
