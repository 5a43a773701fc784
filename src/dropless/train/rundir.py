"""Run directories: a marker file says a folder is a dropless run (so an existing folder of
someone's files is never written into), a lock file keeps a second process out, and
default names never collide."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """`RUN_DIR/.dropless-run.lock` holding this process's pid and host while it trains."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
        self.held = False

    def _holder(self) -> dict | None:
        try:
            d = json.loads(self.path.read_text())
            return d if isinstance(d, dict) and "pid" in d else None
        except (OSError, ValueError):
            return None  # half-written by a process that died: stale

    def acquire(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder and (
                    holder.get("host") != socket.gethostname() or _alive(int(holder["pid"]))
                ):
                    raise ValueError(
                        f"the run directory {str(self.path.parent)!r} is in use by process {holder['pid']} on "
                        f"{holder.get('host')!r} (lock file {self.path.name}); wait for it to finish, or delete "
                        "the lock file if that process no longer runs"
                    ) from None
                self.path.unlink(missing_ok=True)  # a dead local process's lock: take it over
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.mine)
            self.held = True
            return

    def release(self) -> None:
        if self.held and self._holder() == json.loads(self.mine):
            self.path.unlink(missing_ok=True)
        self.held = False


def claim(run_dir: Path, resume: bool) -> RunLock:
    """Check that `run_dir` may be used, mark it as a run (new runs) and lock it."""
    run_dir = Path(run_dir)
    try:
        if run_dir.is_dir() and any(run_dir.iterdir()) and not is_run_dir(run_dir):
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
        if not resume and not is_run_dir(run_dir):
            (run_dir / MARKER).write_text("dropless training run\n")
        lock = RunLock(run_dir)
        lock.acquire()
    except OSError as e:
        raise ValueError(
            f"the run directory {str(run_dir)!r} is not writable ({e.strerror}); pass --run-dir to a writable directory"
        ) from None
    return lock


__all__ = ["LOCK", "MARKER", "RunLock", "claim", "is_run_dir", "new_run_dir"]
