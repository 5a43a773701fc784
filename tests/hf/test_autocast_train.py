"""`dropless train examples/tiny.toml --set precision.dtype=bf16` runs its expert GEMMs in
bf16 (fp32 weights under autocast) on one process, and completes under torchrun with 2
processes and `parallel.ep=2` (the all-to-all moving bf16 is checked in
tests/parallel/_checks_autocast.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from test_autocast import spy_expert_gemms

from dropless.cli.main import main
from harness import read_metrics, torchrun

TINY_TOML = Path(__file__).parents[2] / "examples" / "tiny.toml"
RUN = (
    "precision.dtype=bf16",
    "train.steps=2",
    "train.seq_len=16",
    "train.batch_size=2",
    "data.max_bytes=20000",
    "data.eval_tokens=64",
    "log.every=1",
    "checkpoint.every=0",
    "log.plots=false",
    "log.tensorboard=false",
    "log.progress=plain",
)


def _args(*extra: str) -> list[str]:
    out = [str(TINY_TOML)]
    for item in (*RUN, *extra):
        out += ["--set", item]
    return out


def _losses(run_dir: Path) -> list[float]:
    recs = read_metrics(run_dir)
    return [r["loss"] for r in recs if r.get("loss") is not None]


def test_train_bf16_one_process_runs_the_experts_in_bf16(tmp_path, monkeypatch):
    seen = spy_expert_gemms(monkeypatch)
    assert main(["train", "--run-dir", str(tmp_path / "run"), *_args()]) == 0
    losses = _losses(tmp_path / "run")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert seen and all(dts == {torch.bfloat16} for _, dts in seen), {
        (op, tuple(map(str, d))) for op, d in seen
    }


# ~23 s: opt-in; bf16 experts under autocast run on every run in
# test_train_bf16_one_process_runs_the_experts_in_bf16, expert parallelism under torchrun
# in tests/parallel/test_train_ep.py
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DROPLESS_SLOW_TESTS"), reason="set DROPLESS_SLOW_TESTS=1")
def test_train_bf16_torchrun_ep2(tmp_path):
    run = tmp_path / "ep"
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    args = ["-m", "dropless", "train", "--run-dir", str(run), *_args("parallel.ep=2")]
    proc = torchrun(2, args, env=env, timeout=300, check=True)
    assert "2 processes on cpu" in proc.stdout
    losses = _losses(run)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
