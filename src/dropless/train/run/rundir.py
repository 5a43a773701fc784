"""Run directories: a marker file says a folder is a dropless run (so an existing folder of
someone's files is never written into), a lock (an flock held for the run's life) keeps a
second process out, and default names never collide."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from .atomic import write_atomic

MARKER = ".dropless-run"
LOCK = ".dropless-run.lock"


def is_run_dir(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def new_run_dir(root: str | Path = "runs") -> Path:
    """runs/<YYYYmmdd-HHMMSS>, with -2, -3, ... when that name is taken (created here, so
    two runs started in the same second get different directories)."""
    base = Path(root) / time.strftime("%Y%m%d-%H%M%S")
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        p = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            p.mkdir()
            return p
        except FileExistsError:
            continue
    raise ValueError(
        f"could not find a free run directory name next to {str(base)!r}; pass --run-dir"
    )


class RunLock:
    """An exclusive `fcntl.flock` on `RUN_DIR/.dropless-run.lock`, held on an open file for
    the run's life: the kernel releases it when the process ends, however it ends, and it
    holds across PID namespaces and containers sharing the file system. The pid, host
    and start time written into the file are for the refusal message only."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.mine = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def _holder(self) -> dict:
        try:
            d = json.loads(self.path.read_text())
            return d if isinstance(d, dict) else {}
        except (OSError, ValueError):
            return {}  # the holder has not written its details yet

    def acquire(self) -> None:
        """Hold the lock, or raise ValueError naming the holder (never returns without it)."""
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ValueError(self._in_use()) from None
            except OSError as e:  # e.g. a network file system mounted without flock support
                os.close(fd)
                raise ValueError(
                    f"the run directory {str(self.path.parent)!r} cannot be locked ({e.strerror}): its file "
                    "system does not support flock; pass a --run-dir on a local disk (or a file system "
                    "mounted with flock support)"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            if not self._is_current(fd):  # the holder removed this file as we opened it
                os.close(fd)
                continue
            self.fd = fd
            try:  # details for a refused second process; the lock itself is the flock
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(self.mine).encode(), 0)
            except OSError:
                pass  # a read-only file system: the lock still holds
            return
        raise ValueError(self._in_use())

    def _in_use(self) -> str:
        h = self._holder()
        who = f"process {h.get('pid', '?')} on {h.get('host', '?')!r}" if h else "another process"
        return (
            f"the run directory {str(self.path.parent)!r} is in use by {who} (it holds the lock on "
            f"{self.path.name}); wait for it to finish, or pass another --run-dir"
        )

    def _is_current(self, fd: int) -> bool:
        try:
            held, now = os.fstat(fd), os.stat(self.path)
        except OSError:
            return False
        return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)

    def release(self) -> None:
        """Drop the lock; never raises (the run's own error, if any, is the one to show)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:  # removed while still held: a process that opens it later makes a new one
            if self._is_current(fd):
                self.path.unlink()
        except OSError:
            pass  # a read-only directory: the file stays, the lock goes with the close
        try:
            os.close(fd)  # closing the last descriptor releases the flock
        except OSError:
            pass


def discard_new_run(run_dir: Path, lock: RunLock | None) -> None:
    """Remove a run directory this process created when the run failed before training:
    only our own files, and only while we hold its lock (else only if it is empty)."""
    run_dir = Path(run_dir)
    if lock is not None and lock.held:
        for name in (MARKER, "config.toml", "tokenizer", "data", LOCK):
            p = run_dir / name
            try:  # never raises: the error that stopped the run is the one to show
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                elif p.exists() or p.is_symlink():
                    p.unlink(missing_ok=True)
            except OSError:
                pass
        lock.release()
    try:
        run_dir.rmdir()  # fails, and keeps it, if anything else is inside
    except OSError:
        pass


def claim(run_dir: Path, resume: bool) -> RunLock:
    """Check that `run_dir` may be used, mark it as a run (new runs) and lock it."""
    run_dir = Path(run_dir)
    try:
        # the lock file (or a marker being written) of a run starting now counts as a run's
        others = run_dir.is_dir() and any(MARKER not in p.name for p in run_dir.iterdir())
        if others and not is_run_dir(run_dir):
            legacy = (
                resume
                and (run_dir / "checkpoints").is_dir()
                and (run_dir / "config.toml").is_file()
            )
            if not legacy:
                raise ValueError(
                    f"--run-dir {str(run_dir)!r} is an existing folder that is not a dropless run (no {MARKER} file); "
                    "nothing was written there: pass a new or empty directory"
                )
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir)
        lock.acquire()
        if not resume and not is_run_dir(run_dir):
            try:
                write_atomic(run_dir / MARKER, "dropless training run\n")
            except BaseException:
                lock.release()
                raise
    except OSError as e:
        raise ValueError(
            f"the run directory {str(run_dir)!r} is not writable ({e.strerror}); pass --run-dir to a writable directory"
        ) from None
    return lock


__all__ = ["LOCK", "MARKER", "RunLock", "claim", "discard_new_run", "is_run_dir", "new_run_dir"]
