"""What a run writes is written whole and only where it belongs: never through a symlink,
config.toml and metrics.jsonl replaced atomically, a bare --resume on the checkpoint's own
(verified) config, no folder left by a run that never started, and a run whose directory
vanished stops with an error."""

import errno
import json
import os
import shutil

from dropless.cli.main import main
from dropless.train.checkpoint import store as ckpt
from dropless.train.config.load import load_config
from dropless.train.run.hooks import TrainHooks

from .faults_util import NaNAt, args, records, with_hooks

MORE = ["--resume", "--set", "train.steps=9"]


def test_a_symlinked_metrics_or_config_file_is_refused(run_copy, tmp_path, capsys):
    outside = tmp_path / "precious.txt"
    for name in ("metrics.jsonl", "config.toml"):
        outside.write_text("keep me\n")
        (run_copy / name).rename(tmp_path / f"{name}.real")
        (run_copy / name).symlink_to(outside)
        assert main(["train", "--run-dir", str(run_copy), *MORE]) == 2
        err = capsys.readouterr().err
        assert f"{name}' is a symlink (to '{outside}')" in err and err.count("\n") == 1, err
        assert outside.read_text() == "keep me\n"
        (run_copy / name).unlink()
        (tmp_path / f"{name}.real").rename(run_copy / name)


def test_bare_resume_takes_the_config_from_the_checkpoint(run_copy):
    (run_copy / "config.toml").write_text("")  # a start cut short while writing it
    assert main(["train", "--run-dir", str(run_copy), *MORE]) == 0
    saved = load_config(ckpt.step_dir(run_copy, 8) / "config.toml", ["train.steps=9"])
    assert load_config(run_copy / "config.toml") == saved  # the checkpoint's, and the override
    assert saved.model.hidden_size == 32  # the tiny run's, not the defaults


def test_a_failed_metrics_rewrite_leaves_the_file_whole(run_copy, monkeypatch, capsys):
    shutil.rmtree(ckpt.step_dir(run_copy, 8))  # resume at 4: records 6 and 8 are dropped
    before = (run_copy / "metrics.jsonl").read_bytes()
    real_fsync = os.fsync

    def failing(fd):  # the disk fails while the shortened metrics are written
        if "metrics.jsonl" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    assert main(["train", "--run-dir", str(run_copy), *MORE]) == 2
    assert "Input/output error" in capsys.readouterr().err
    assert (run_copy / "metrics.jsonl").read_bytes() == before
    assert [p.name for p in run_copy.iterdir() if ".tmp-" in p.name] == []


def test_a_vanished_run_directory_stops_the_run(run_copy, monkeypatch, capsys):
    class Vanish(TrainHooks):
        def after_step(self, step):
            if step == 9:
                shutil.rmtree(run_copy)

    with_hooks(monkeypatch, Vanish())
    assert main(["train", "--run-dir", str(run_copy), *MORE, "--set", "checkpoint.every=1"]) == 2
    err = capsys.readouterr().err
    assert "vanished during the run (deleted or moved)" in err and err.count("\n") == 1, err
    assert not run_copy.exists()  # not recreated as an unresumable remnant


def test_no_folder_is_left_by_a_run_that_never_started(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": \n')  # found by the reader, after the checks
    missing = tmp_path / "missing.txt"  # refused by the checks before any work
    empty = tmp_path / "empty"  # an existing empty folder stays empty (the marker removed)
    empty.mkdir()
    for extra in (["--set", f"data.path={bad}"], ["--set", f"data.path={missing}"]):
        for where in ([], ["--run-dir", str(tmp_path / "new")], ["--run-dir", str(empty)]):
            assert main(["train", *where, *args(), *extra]) == 2, capsys.readouterr().err
            assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
            assert not (tmp_path / "new").exists() and list(empty.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "empty", "runs"]
    capsys.readouterr()
    assert main(["train", "--resume", "--run-dir", str(tmp_path / "typo")]) == 2
    err = capsys.readouterr().err
    assert "does not exist (nothing was created)" in err and not (tmp_path / "typo").exists()


def test_every_checkpoint_damaged_gives_one_way_out(run_copy, tmp_path, capsys):
    for step in (4, 8):
        f = ckpt.step_dir(run_copy, step) / "trainer.json"
        f.write_text(f.read_text().replace('"step"', '"stap"'))
    assert main(["train", "--run-dir", str(run_copy), "--resume"]) == 2
    lines = capsys.readouterr().err.splitlines()
    warned = [x for x in lines if "warning" in x]
    assert len(warned) == 2 and all(x.endswith("; no older checkpoint verifies") for x in warned)
    assert (
        "start a new run with another --run-dir" in lines[-1]
        and "without --resume" not in lines[-1]
    )
    assert main(["train", "--run-dir", str(run_copy), *args()]) == 2
    err = capsys.readouterr().err
    assert "holds checkpoints but none verifies" in err and "pass --resume" not in err
    assert "another --run-dir" in err
    # what both say works: a new run directory
    new = ["train", "--run-dir", str(tmp_path / "new"), *args("train.steps=1")]
    assert main([*new, "--set", "log.plots=false", "--set", "log.tensorboard=false"]) == 0


def test_nonfinite_advice_fits_the_checkpoints_there_are(run_copy, tmp_path, monkeypatch, capsys):
    # before any checkpoint: nothing to resume; the same command again works
    fresh = ["train", "--run-dir", str(tmp_path / "f"), *args("train.steps=2", "log.plots=false")]
    with_hooks(monkeypatch, NaNAt(1))
    assert main(fresh) == 2
    err = capsys.readouterr().err
    assert "no checkpoint was written yet" in err and "--resume" not in err, err
    monkeypatch.undo()
    assert main(fresh) == 0
    # the checkpoint just resumed from gives it at once: the older one is offered
    with_hooks(monkeypatch, NaNAt(9))
    assert main(["train", "--run-dir", str(run_copy), *MORE]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    newest, aside = ckpt.step_dir(run_copy, 8), run_copy / "step_00000008.nonfinite"
    assert f"set it aside (mv {newest} {aside}) and --resume from step_00000004" in err, err
    monkeypatch.undo()
    newest.rename(aside)  # what it says, then it resumes from step 4
    assert main(["train", "--run-dir", str(run_copy), *MORE, "--set", "optim.lr=5e-3"]) == 0
    assert sorted(records(run_copy))[-1] == 9
    assert json.loads((run_copy / "summary.json").read_text())["steps"] == 9
