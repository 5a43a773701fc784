"""SIGKILL in the middle of a checkpoint write leaves the previous checkpoint loadable."""

import json
import signal
import subprocess
import sys

from conftest import sub_env, tiny_args
from dropless.cli.main import main
from dropless.train import checkpoint as ckpt


def test_kill_during_checkpoint_write_then_resume(tiny_run, tmp_path):
    run_dir = tmp_path / "killed"
    env = sub_env()
    env[ckpt.KILL_HOOK_ENV] = "8"  # die right after the first file of the step-8 checkpoint
    proc = subprocess.run(
        [sys.executable, "-m", "dropless", "train", "--run-dir", str(run_dir), *tiny_args()],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    partial = run_dir / "checkpoints" / ".tmp-step_00000008"
    assert partial.is_dir() and list(partial.rglob("*.pt"))  # the write had started
    assert ckpt.latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_00000004"
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [4]

    assert main(["train", "--run-dir", str(run_dir), "--resume"]) == 0
    assert not partial.exists()
    assert ckpt.latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_00000008"
    # the same losses as the uninterrupted run (both single-threaded, same code)
    want = [json.loads(x) for x in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [0, 2, 4, 6, 8]
    assert [r.get("loss") for r in got] == [r.get("loss") for r in want]
    assert [r["eval_loss"] for r in got] == [r["eval_loss"] for r in want]
