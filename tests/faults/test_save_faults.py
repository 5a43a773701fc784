"""A save cut short (SIGKILL at each phase, a truncated shard, a zeroed trainer.json, a
full disk) never loses the previous complete checkpoint, and the run resumes exactly."""

import errno
import shutil
import signal

import pytest

from dropless.cli.main import main
from dropless.train.checkpoint import store as ckpt
from dropless.train.run.hooks import CHECKPOINT_PHASES

from .faults_util import forked_children, records, snapshot

MORE = ["--resume", "--set", "train.steps=10", "--set", "checkpoint.every=1"]


def test_sigkill_at_every_phase_of_a_save(finished_run, tmp_path, continued, capsys):
    runs = [tmp_path / phase for phase in CHECKPOINT_PHASES]
    for run in runs:
        shutil.copytree(finished_run, run)
    jobs = [
        ({"checkpoint": [run.name, 9]}, ["train", "--run-dir", str(run), *MORE]) for run in runs
    ]
    for run, (code, err) in zip(runs, forked_children(jobs, tmp_path)):
        phase = run.name
        assert code == -signal.SIGKILL, (phase, err[-2000:])
        steps = [s for s, _ in ckpt.list_checkpoints(run)]
        # killed after the rename, before pruning: step 9 is complete, 4 not yet removed
        assert steps == ([4, 8, 9] if phase == "after_rename" else [4, 8]), phase
        assert ckpt.verify_checkpoint(ckpt.latest_checkpoint(run)) is None
        partial = run / "checkpoints" / ".tmp-step_00000009"
        assert partial.is_dir() == (phase != "after_rename"), phase
        # --resume continues with the newest complete checkpoint's config (steps=8 in step 8's,
        # the killed resume's steps=10 only in step 9's): steps=10 is given again; step 10 is exact
        more = ["--resume", "--set", "train.steps=10"]
        assert main(["train", "--run-dir", str(run), *more]) == 0, capsys.readouterr().err
        got = records(run)
        assert got[10]["loss"] == continued[10]["loss"], phase
        assert got[10]["eval_loss"] == continued[10]["eval_loss"], phase
        assert not partial.exists()


@pytest.mark.parametrize("damage", ["truncated shard", "zeroed trainer.json"])
def test_damaged_latest_checkpoint_falls_back(finished_run, run_copy, damage, capsys):
    ck = ckpt.step_dir(run_copy, 8)
    if damage == "truncated shard":
        shard = next(ck.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        f = ck / "trainer.json"
        f.write_bytes(b"\0" * f.stat().st_size)
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_00000008"):
        assert ckpt.latest_checkpoint(run_copy) == ckpt.step_dir(run_copy, 4)
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run_copy), "--resume"]) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert len(warned) == 1 and warned[0].startswith("dropless: warning: skipping checkpoint")
    assert warned[0].endswith("; using the previous complete one, step_00000004"), warned
    straight, resumed = records(finished_run), records(run_copy)
    for step in (6, 8):  # redone from step 4, bit for bit
        assert resumed[step]["loss"] == straight[step]["loss"]
        assert resumed[step]["eval_loss"] == straight[step]["eval_loss"]
    assert ckpt.verify_checkpoint(ckpt.step_dir(run_copy, 8)) is None  # rewritten whole


def test_disk_full_is_one_line_and_keeps_checkpoints(run_copy, monkeypatch, capsys):
    before = {s: snapshot(p) for s, p in ckpt.list_checkpoints(run_copy)}

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt, "write_synced", full)
    assert main(["train", "--run-dir", str(run_copy), *MORE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "dropless train: error: No space left on device (" in err
    assert "check free space and permissions of the run directory, then --resume" in err
    assert {s: snapshot(p) for s, p in ckpt.list_checkpoints(run_copy)} == before
    monkeypatch.undo()
    assert main(["train", "--run-dir", str(run_copy), *MORE[:1], "--set", "train.steps=9"]) == 0
    assert [s for s, _ in ckpt.list_checkpoints(run_copy)] == [8, 9]


def test_unloadable_checkpoint_is_one_line_and_writes_nothing(run_copy, monkeypatch, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def broken(*args, **kwargs):
        raise CheckpointException("load", {0: (RuntimeError("size mismatch for model.x"), None)})

    monkeypatch.setattr(dcp, "load", broken)
    before = snapshot(run_copy)
    assert main(["train", "--run-dir", str(run_copy), *MORE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (
        "the checkpoint could not be read or written (RuntimeError: size mismatch for model.x)"
        in err
    )
    assert snapshot(run_copy) == before  # tokenizer, cache, config, metrics: as they were
    with pytest.raises(CheckpointException):
        main(["--debug", "train", "--run-dir", str(run_copy), *MORE])
