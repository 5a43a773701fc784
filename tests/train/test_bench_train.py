"""`dropless bench train`: a brief run of the train config recorded from its own summary."""

from __future__ import annotations

import json

from dropless.cli.main import main
from harness import tiny_args


def test_bench_train_records_the_run_summary(tmp_path):
    hist, section = tmp_path / "h.jsonl", tmp_path / "train.md"
    argv = ["bench", "train", "--steps", "2", *tiny_args(), "--history", str(hist)]
    assert main([*argv, "--section", str(section)]) == 0
    line = json.loads(hist.read_text())
    f = line["figures"]
    assert line["bench"] == "train" and f["steps"] == 2  # --steps wins over the config's
    assert f["overrides"][-1] == "train.steps=2" and f["tokens_per_s"] > 0
    assert f["final_bpb"] is not None and line["load"]["before"]["loadavg"]
    text = section.read_text()
    assert line["command"] in text and f"| steps x tokens per step | 2 x {4 * 32:,} |" in text
