"""Off a terminal (`dropless train > log`) a run prints a plain line when it has been
silent for `heartbeat.INTERVAL_S`: while it prepares the data and between log steps.
The interval is shortened here by monkeypatching the module constant."""

import sys
import time

from dropless.train import build, trainer
from dropless.train.config.recipes import tiny
from dropless.train.report import heartbeat
from dropless.train.run.hooks import TrainHooks

QUIET = ("log.plots=false", "log.tensorboard=false", "optim.warmup_steps=0")


class SlowStep(TrainHooks):
    def after_step(self, step: int) -> None:
        # step 2 ends before its log line; step 3 runs between the log lines of steps 2 and 4
        if step in (2, 3):
            time.sleep(0.3)


def test_silent_stretches_get_a_line_off_a_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.1)
    prepare = build.prepare_data

    def slow_prepare(*args):
        time.sleep(0.3)
        return prepare(*args)

    monkeypatch.setattr(build, "prepare_data", slow_prepare)
    cfg = tiny("train.steps=4", "data.max_bytes=20000", *QUIET)
    trainer.train(cfg, run_dir=str(tmp_path / "r"), hooks=SlowStep())
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, t in enumerate(lines) if "Qwen3MoeForCausalLM" in t)
    step2 = next(i for i, t in enumerate(lines) if t.startswith("step     2"))
    step4 = next(i for i, t in enumerate(lines) if t.startswith("step     4"))
    before = [t for t in lines[:header] if "preparing the data" in t]
    assert before and before[0].startswith("dropless train: preparing the data"), lines
    assert before[0].endswith(" s since the start)")
    # step 1 ran since the last log step (none yet): its rate
    during2 = [
        t for t in lines[header:step2] if t.startswith("dropless train: running step 2 of 4")
    ]
    assert during2 and "tokens/s since the last log step (log.every=2)" in during2[0], lines
    # right after the log step of step 2 no step ran since: the rate of the run's steps so far
    during3 = [t for t in lines[step2:step4] if t.startswith("dropless train: running step 3 of 4")]
    assert during3 and "tokens/s over the 2 steps of this run so far" in during3[0], lines


def test_no_line_on_a_terminal_or_with_progress_off(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert not heartbeat.Heartbeat.for_run(True, "plain").enabled
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    beat = heartbeat.Heartbeat.for_run(True, "auto")
    assert beat.enabled and beat._thread.is_alive()
    beat.close()
    assert not beat._thread.is_alive()
    assert not heartbeat.Heartbeat.for_run(True, "none").enabled
    assert not heartbeat.Heartbeat.for_run(False, "auto").enabled  # rank 0 only
