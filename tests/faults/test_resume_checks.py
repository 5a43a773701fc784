"""--resume refuses a config the checkpoint cannot continue with (naming each key and both
values) and writes nothing; a bare --resume uses the run's own config; a foreign folder
is refused and left as it was (a locked one: test_run_lock.py)."""

import os

import pytest

from dropless.cli.main import main
from dropless.train.checkpoint.resume import check_resume
from dropless.train.config.load import load_config
from dropless.train.run.rundir import MARKER, new_run_dir

from .faults_util import args, records, snapshot


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.hidden_size=64", "model.hidden_size: checkpoint 32, now 64"),
        ("model.vocab_size=512", "model.vocab_size: checkpoint 0, now 512"),
        ("data.tokenizer=bpe", "data.tokenizer: checkpoint 'bytes', now 'bpe'"),
        ("model.num_experts=8", "model.num_experts: checkpoint 4, now 8"),
        ("train.seq_len=16", "train.seq_len: checkpoint 32, now 16"),
        ("data.max_bytes=200000", "data.max_bytes: checkpoint 300000, now 200000"),
        ("train.seed=1", "train.seed: checkpoint 0, now 1"),
        ("train.expert_bias_rate=0.01", "train.expert_bias_rate: checkpoint 0.0, now 0.01"),
    ],
)
def test_changed_fixed_key_is_refused_untouched(run_copy, override, named, capsys):
    before = snapshot(run_copy)
    assert main(["train", "--run-dir", str(run_copy), "--resume", "--set", override]) == 2
    err = capsys.readouterr().err
    assert "--resume: the checkpoint" in err and named in err and err.count("\n") == 1
    assert "Drop those overrides (a bare --resume uses the run's own config)" in err
    assert snapshot(run_copy) == before  # nothing written, lock released


def test_data_path_change_is_refused(run_copy, tmp_path, capsys):
    (tmp_path / "d.txt").write_text("other data " * 2000)
    assert (
        main(
            [
                "train",
                "--run-dir",
                str(run_copy),
                "--resume",
                "--set",
                f"data.path={tmp_path / 'd.txt'}",
            ]
        )
        == 2
    )
    assert "data.path: checkpoint '', now '" in capsys.readouterr().err


def test_bare_resume_uses_the_newest_runs_own_config(run_copy, monkeypatch, capsys):
    monkeypatch.chdir(run_copy.parent)
    (run_copy.parent / "runs").mkdir()
    run_copy.rename(run_copy.parent / "runs" / "a")
    # allowed changes: steps, schedule, log and checkpoint cadence
    extra = ["--set", "train.steps=10", "--set", "optim.lr=5e-3", "--set", "log.every=1"]
    assert main(["train", "--resume", *extra]) == 0
    recs = records(run_copy.parent / "runs" / "a")
    assert sorted(recs) == [0, 2, 4, 6, 8, 9, 10] and recs[10]["lr"] > 0
    cfg = load_config(run_copy.parent / "runs" / "a" / "config.toml")
    assert cfg.model.hidden_size == 32 and cfg.train.steps == 10  # the tiny run, not the default


def test_saved_ep_that_does_not_fit_names_the_override(finished_run, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    saved = load_config(finished_run / "config.toml", ["parallel.ep=2"])
    from dropless.train.config.load import dump_config

    dump_config(saved, ck / "config.toml")
    with pytest.raises(
        ValueError,
        match=r"saved with parallel.ep=2.*does not fit 1 process .*add --set parallel.ep=1",
    ):
        check_resume(saved, ck, world=1)
    check_resume(saved, ck, world=2)  # fits: kept


def test_foreign_folder_is_refused_untouched(tmp_path, capsys):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "cat.jpg").write_bytes(b"\xff\xd8 not really")
    before = snapshot(mine)
    assert main(["train", "--run-dir", str(mine), *args()]) == 2
    err = capsys.readouterr().err
    assert (
        f"is an existing folder that is not a dropless run (no {MARKER} file); nothing was written there"
        in err
    )
    assert snapshot(mine) == before and sorted(os.listdir(mine)) == ["cat.jpg"]


def test_default_run_dirs_never_collide(tmp_path):
    a, b, c = (new_run_dir(tmp_path / "runs") for _ in range(3))
    assert len({a, b, c}) == 3 and all(p.is_dir() for p in (a, b, c))
