"""NaN gradients at step k: "stop" ends the run with one line and touches no checkpoint;
"skip" drops the update, counts it, and stops after train.max_skipped_steps in a row."""

import math

from dropless.cli.main import main
from dropless.train.checkpoint import store as ckpt
from dropless.train.step import nonfinite_message

from .faults_util import NaNAt, records, snapshot, weights_finite, with_hooks

MORE = [
    "--resume",
    "--set",
    "train.steps=12",
    "--set",
    "checkpoint.every=1",
    "--set",
    "log.every=1",
]


def test_stop_policy(run_copy, monkeypatch, capsys):
    with_hooks(monkeypatch, NaNAt(10))
    assert main(["train", "--run-dir", str(run_copy), *MORE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless train: step 10: grad norm is nan;") and err.count("\n") == 1
    assert "no weight was updated and no checkpoint was written or removed" in err
    assert [s for s, _ in ckpt.list_checkpoints(run_copy)] == [8, 9]  # keep=2: 4 pruned by 9
    assert weights_finite(ckpt.step_dir(run_copy, 9))
    assert max(records(run_copy)) == 9


def test_skip_policy_counts_and_continues(run_copy, monkeypatch, capsys):
    with_hooks(monkeypatch, NaNAt(10))
    skip = ["--set", "train.on_nonfinite=skip"]
    assert main(["train", "--run-dir", str(run_copy), *MORE, *skip]) == 0
    recs = records(run_copy)
    assert recs[10]["skipped_steps"] == 1 and math.isnan(recs[10]["grad_norm"])
    assert recs[10]["loss_avg"] is None and recs[11]["skipped_steps"] == 0
    assert math.isfinite(recs[12]["loss"]) and weights_finite(ckpt.step_dir(run_copy, 12))


def test_skip_policy_stops_after_too_many_in_a_row(run_copy, monkeypatch, capsys):
    with_hooks(monkeypatch, NaNAt(10, 11))
    skip = ["--set", "train.on_nonfinite=skip", "--set", "train.max_skipped_steps=1"]
    assert main(["train", "--run-dir", str(run_copy), *MORE, *skip]) == 2
    err = capsys.readouterr().err
    assert "step 11: grad norm is nan" in err and "raise train.max_skipped_steps" in err
    # step 10 (skipped, weights as at 9) was saved; step 11 stopped before any write
    assert [s for s, _ in ckpt.list_checkpoints(run_copy)] == [9, 10]
    assert snapshot(ckpt.step_dir(run_copy, 10) / "rng") != {}
    assert weights_finite(ckpt.step_dir(run_copy, 10))


def test_message_names_what_was_bad():
    assert nonfinite_message(3, float("nan"), 1.0, "stop").startswith("step 3: loss is nan;")
    both = nonfinite_message(4, float("inf"), float("nan"), "stop")
    assert "loss is inf and grad norm is nan" in both
