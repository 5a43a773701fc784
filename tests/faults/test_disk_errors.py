"""Disk errors read as what they are: a full disk during the DCP write says "No space left
on device" (a real tmpfs that fills up, where this machine may mount one), and a lock
release that fails too never hides the error that stopped the run."""

import errno
import io
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

from dropless.cli.main import main
from dropless.train.checkpoint import store as ckpt
from dropless.train.run.rundir import LOCK

from .faults_util import args, snapshot


def _du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@contextmanager
def _small_tmpfs(where: Path, size: int):
    where.mkdir()
    opts = f"size={size}"
    # fault: a full disk (a small tmpfs); not a Python child
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True
    ).returncode:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


class _FillsUp(io.RawIOBase):
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, b) -> int:
        n = len(memoryview(b).cast("B"))
        if n > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= n
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_during_the_shard_write_is_named(run_copy, tmp_path, monkeypatch, capsys):
    shutil.rmtree(ckpt.step_dir(run_copy, 4))
    mount = tmp_path / "small"
    # room for the run as it is and a little more, not for another checkpoint's shard
    with _small_tmpfs(mount, _du(run_copy) + 256 * 1024) as mounted:
        if mounted:
            run = mount / "run"
            shutil.copytree(run_copy, run)
        else:  # no tmpfs here (not root): the shard's file fills up instead
            from torch.distributed.checkpoint import filesystem as dcp_fs

            run, real = run_copy, dcp_fs.FileSystem.create_stream

            @contextmanager
            def filling(self, path, mode):
                with real(self, path, mode) as f:
                    yield _FillsUp(f, 64 * 1024) if str(path).endswith(".distcp") else f

            monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", filling)
        before = snapshot(ckpt.step_dir(run, 8))
        more = ["--resume", "--set", "train.steps=9", "--set", "checkpoint.every=1"]
        assert main(["train", "--run-dir", str(run), *more]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dropless train: error: No space left on device"), err
        assert err.count("\n") == 1 and "unexpected pos" not in err
        assert snapshot(ckpt.step_dir(run, 8)) == before
        assert [s for s, _ in ckpt.list_checkpoints(run)] == [8]


def test_a_failing_lock_release_keeps_the_real_error(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": \n')
    real_unlink = Path.unlink

    def read_only(self, missing_ok=False):
        if self.name == LOCK:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *args(f"data.path={bad}")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2: not a JSON line" in err and "Read-only" not in err, err
