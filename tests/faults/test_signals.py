"""SIGINT / SIGTERM in the middle of a step: the step finishes, a checkpoint is written,
the process says how to resume and exits non-zero without a traceback; the resumed run is
exact. A second Ctrl-C stops at once. On 2 gloo ranks every rank stops at the same step,
and a rank killed during a save leaves the previous checkpoint whole; before that, in the
same torchrun, a refused start (a finished run's folder) raises the same error on both
ranks and leaves the folder as it was."""

import shutil
import signal

from dropless.cli.main import main
from dropless.train.checkpoint import store as ckpt

from .faults_util import args, child, forked_children, records, snapshot

MORE = ["--resume", "--set", "train.steps=10", "--set", "checkpoint.every=0"]


def test_sigint_sigterm_and_a_second_ctrl_c(finished_run, tmp_path, continued):
    cases = {  # name: (signal spec, exit status)
        "SIGINT": ([9, "SIGINT"], 128 + signal.SIGINT),
        "SIGTERM": ([9, "SIGTERM"], 128 + signal.SIGTERM),
        "twice": ([9, "SIGINT", 2], 130),
    }
    runs = [tmp_path / name for name in cases]
    for run in runs:
        shutil.copytree(finished_run, run)
    jobs = [
        ({"signal_in_step": cases[r.name][0]}, ["train", "--run-dir", str(r), *MORE]) for r in runs
    ]
    for run, (code, err) in zip(runs, forked_children(jobs, tmp_path)):
        name = run.name
        assert code == cases[name][1], (name, err[-2000:])
        assert "Traceback" not in err, name
        steps = [s for s, _ in ckpt.list_checkpoints(run)]
        if name == "twice":  # stopped at once: nothing saved past step 8
            assert (
                "interrupted at once (Ctrl-C outside a step, or a second one)" in err
                and steps == [4, 8]
            )
            continue
        assert f"stopped by {name} after step 9; checkpoint " in err
        assert f"Resume with: dropless train --run-dir {run} --resume" in err
        assert steps == [8, 9]
        assert main(["train", "--run-dir", str(run), "--resume"]) == 0
        assert records(run)[10]["loss"] == continued[10]["loss"], name
        assert records(run)[10]["eval_loss"] == continued[10]["eval_loss"], name


def test_two_ranks_stop_together_and_survive_a_kill_during_save(finished_run, tmp_path):
    run, done, errors = tmp_path / "run", tmp_path / "done", tmp_path / "errors"
    run_args = args(
        "train.steps=6",
        "checkpoint.every=2",
        "log.every=1",
        "log.plots=false",
        "log.tensorboard=false",
    )
    # first, in the same torchrun: a fresh start in a finished run's folder is refused, by
    # rank 0 under the lock, and every rank raises that error; the folder is left as it was
    shutil.copytree(finished_run, done)
    errors.mkdir()
    before = snapshot(done)
    refused = ({"error_to": str(errors)}, ["train", "--run-dir", str(done), *run_args])
    # rank 1 alone gets SIGTERM in step 3: both ranks must stop after step 3 and save it
    # together (step 3 is no checkpoint step), and rank 1 dies in the middle of that save
    spec = {"rank": 1, "signal_in_step": [3, "SIGTERM"], "checkpoint": ["before_shards", 3]}
    proc = child(spec, ["train", "--run-dir", str(run), *run_args], torchrun=2, before=[refused])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-3000:]
    said = [(errors / f"rank{r}.txt").read_text() for r in (0, 1)]
    want = f"ValueError: {str(done)!r} already holds checkpoints: pass --resume to continue"
    assert said[0] == said[1] and said[0].startswith(want), said
    assert snapshot(done) == before
    assert sorted(records(run)) == [0, 1, 2, 3]  # rank 0 stopped after step 3 too
    assert (run / "checkpoints" / ".tmp-step_00000003").is_dir()  # it began saving step 3
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]  # the save did not complete
    assert ckpt.verify_checkpoint(ckpt.step_dir(run, 2)) is None
    # resume on one process (the checkpoint reshards): one micro-batch per former rank
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.grad_accum=2"]) == 0
    assert sorted(records(run)) == [0, 1, 2, 3, 4, 5, 6]
