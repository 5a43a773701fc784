"""Run directories: a marker file says a folder is a dropless run (so an existing folder of
someone's files is never written into), a lock (an flock held for the run's life) keeps a
second process out, and default names never collide."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
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


#: the files a run writes into its folder before its first step (removed when it is refused)
_STARTING_FILES = (MARKER, "config.toml", "tokenizer", "data")


def _remove_files(run_dir: Path, names) -> None:
    """Remove these names of `run_dir` (files, links or folders); never raises."""
    for name in names:
        p = run_dir / name
        try:  # never raises: the error that stopped the run is the one to show
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists() or p.is_symlink():
                p.unlink(missing_ok=True)
        except OSError:
            pass


def remove_if_empty(run_dir: Path) -> None:
    """Remove `run_dir` unless anything is inside; never raises."""
    try:
        Path(run_dir).rmdir()
    except OSError:
        pass


class Claim:
    """A run directory held by this process (`claim`): its lock, whether this process
    created the folder or marked it, and what the checks run under the lock returned."""

    def __init__(self, run_dir: Path, lock: RunLock, created: bool, marked: bool):
        self.run_dir, self.lock, self.created, self.marked = run_dir, lock, created, marked
        self.checked = None

    @property
    def held(self) -> bool:
        return self.lock.held

    def release(self) -> None:
        self.lock.release()

    def discard(self) -> None:
        """The run was refused or failed before training: the folder goes back to what it
        was (a folder this process created is removed; the files a starting run writes are
        removed from one it marked); a run folder it only locked is left as it is."""
        if (self.created or self.marked) and self.lock.held:
            _remove_files(self.run_dir, _STARTING_FILES)
        self.lock.release()
        if self.created:
            remove_if_empty(self.run_dir)


def _foreign(run_dir: Path, resume: bool) -> ValueError | None:
    """The refusal of a folder that holds files but is not a dropless run, else None."""
    # the lock file (or a marker being written) of a run starting now counts as a run's
    others = run_dir.is_dir() and any(MARKER not in p.name for p in run_dir.iterdir())
    if not others or is_run_dir(run_dir):
        return None
    if resume and (run_dir / "checkpoints").is_dir() and (run_dir / "config.toml").is_file():
        return None  # a run written before the marker existed
    return ValueError(
        f"--run-dir {str(run_dir)!r} is an existing folder that is not a dropless run (no {MARKER} file); "
        "nothing was written there: pass a new or empty directory"
    )


def _create_claimed(run_dir: Path) -> RunLock | None:
    """A new run directory created, marked and locked in one step: a hidden folder beside
    it gets the marker and the lock, then is renamed to `run_dir`, so no other process
    ever sees it unmarked or unlocked. None when `run_dir` appeared meanwhile (the rename
    fails on a folder with files; an empty one, holding nothing, is replaced)."""
    if not run_dir.parent.exists():
        run_dir.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        tmp = run_dir.with_name(f".{run_dir.name}.new-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            tmp.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name beside {str(run_dir)!r}")
    lock = RunLock(tmp)
    try:
        lock.acquire()  # nobody else knows this folder: only a file system without flock fails
        write_atomic(tmp / MARKER, "dropless training run\n")
        os.rename(tmp, run_dir)
    except BaseException as e:
        lock.release()
        _remove_files(tmp, (MARKER,))
        try:
            tmp.rmdir()
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return None
        raise
    lock.path = run_dir / LOCK
    return lock


def claim(run_dir: Path, resume: bool, check=None, created: bool = False) -> Claim:
    """Take `run_dir` for a run, then check what it holds: the lock comes first (a new
    folder is created, marked and locked in one step), and every check of the folder's
    contents (a foreign folder here; `check()`, the caller's, e.g. fresh start or resume
    point) runs while holding it, so no other run can change the folder between a check
    and the run. `check()`'s result is the claim's `checked`. A refusal (ValueError)
    leaves the folder as it was: the lock is released and what the claim wrote is
    removed. `created`: this process made the (empty) folder already (`new_run_dir`).
    A --resume (`resume`) needs the folder to exist and creates nothing."""
    run_dir = Path(run_dir)
    if resume and not run_dir.is_dir():
        raise ValueError(
            f"--resume: the run directory {str(run_dir)!r} does not exist (nothing was created); "
            "pass the --run-dir of the run to continue"
        )
    try:
        held = None
        if not resume and not run_dir.exists():
            lock = _create_claimed(run_dir)
            if lock is not None:
                held = Claim(run_dir, lock, created=True, marked=True)
        if held is None:
            refused = _foreign(run_dir, resume)  # before writing anything there
            if refused is not None:
                raise refused
            lock = RunLock(run_dir)
            lock.acquire()
            held = Claim(run_dir, lock, created=created, marked=False)
            try:
                refused = _foreign(run_dir, resume)  # again, now that nobody can change it
                if refused is not None:
                    raise refused
                if not resume and not is_run_dir(run_dir):
                    write_atomic(run_dir / MARKER, "dropless training run\n")
                    held.marked = True
            except BaseException:
                held.discard()
                raise
    except OSError as e:
        raise ValueError(
            f"the run directory {str(run_dir)!r} is not writable ({e.strerror}); pass --run-dir to a writable directory"
        ) from None
    if check is not None:
        try:
            held.checked = check()
        except BaseException:
            held.discard()
            raise
    return held
