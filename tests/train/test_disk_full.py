"""A full disk's error names the file being written: the system gives `No space left on
device` with no file name for a write or an fsync, and `dropless train` says which file
of the run it was writing (docs/train.md, *Fails fast*)."""

import errno
import os
from contextlib import contextmanager

import pytest
from torch.distributed.checkpoint import filesystem as dcp_fs

from dropless.cli.main import main
from dropless.train.checkpoint import store as checkpoint
from dropless.train.run import atomic
from harness import tiny_args


def _enospc(*_args, **_kw):
    raise OSError(errno.ENOSPC, "No space left on device")


class _Full:
    """A file that takes nothing: every write fails as on a full disk."""

    def __init__(self, f):
        self.f = f

    def write(self, b) -> int:
        _enospc()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_during_a_checkpoint_names_the_shard(tmp_path, monkeypatch, capsys):
    real = dcp_fs.FileSystem.create_stream

    @contextmanager
    def full(self, path, mode):
        with real(self, path, mode) as f:
            yield _Full(f) if str(path).endswith(".distcp") else f

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", full)
    run = tmp_path / "run"
    more = ("train.steps=2", "checkpoint.every=2", "optim.warmup_steps=0")
    assert main(["train", "--run-dir", str(run), *tiny_args(*more)]) == 2
    err = capsys.readouterr().err
    final = checkpoint.step_dir(run, 2)
    tmp = final.with_name(".tmp-" + final.name)
    prefix = f"dropless train: error: No space left on device ({tmp}{os.sep}"
    assert err.startswith(prefix) and err.count("\n") == 1, err
    assert err.split(")")[0].endswith(".distcp"), err


@pytest.mark.parametrize("write", ["write_synced", "write_atomic", "fsync_path"])
def test_a_failed_fsync_names_the_file(write, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", _enospc)
    target = tmp_path / "trainer.json"
    with pytest.raises(OSError) as e:
        if write == "write_synced":
            checkpoint.write_synced(target, b"{}")
        elif write == "write_atomic":
            atomic.write_atomic(target, "{}")
        else:
            target.write_text("{}")
            atomic.fsync_path(target)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)


def test_an_append_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: _Full(real(fd, mode)))
    target = tmp_path / "metrics.jsonl"
    with pytest.raises(OSError) as e:
        atomic.append_line(target, "{}")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
