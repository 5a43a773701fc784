"""Writing the files of a run directory so that a crash never leaves half a file and a
symlink never redirects a write: a whole file goes to a temporary name in the same
directory, is fsynced and renamed over the target; appends open the file with
O_NOFOLLOW. A target that is a symlink is refused, naming it. An OSError of a write or
an fsync (a full disk: the system gives no file name there) names the file it wrote."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


def refuse_symlink(path: str | Path) -> None:
    """ValueError if `path` is a symlink (a write there would land outside the run)."""
    p = Path(path)
    if p.is_symlink():
        raise ValueError(
            f"{str(p)!r} is a symlink (to {os.readlink(p)!r}); dropless writes only regular files "
            "of the run directory: remove the link, or pass another --run-dir"
        )


def run_dir_vanished(run_dir: str | Path) -> ValueError:
    return ValueError(
        f"the run directory {str(run_dir)!r} vanished during the run (deleted or moved); the steps "
        "since its last checkpoint are lost: start a new run, or restore the directory and --resume"
    )


@contextmanager
def naming(path: str | Path):
    """An OSError raised in the block without a file name (a write's or an fsync's
    `No space left on device`) gets `path` as its file name: the message names it."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with naming(path):
            os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | Path):
    """A binary file object whose content replaces `path` (temp + fsync + rename + fsync of
    the directory) when the block ends without an error; nothing changes otherwise."""
    p = Path(path)
    refuse_symlink(p)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o666)
    try:
        with naming(p), os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(p.parent)


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Replace `path` with `data` (see `atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


def append_line(path: str | Path, line: str) -> None:
    """Append one line to `path` (created if missing), never through a symlink."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError:
        refuse_symlink(p)  # ELOOP: say what it is
        if not p.parent.is_dir():
            raise run_dir_vanished(p.parent) from None
        raise
    with naming(p), os.fdopen(fd, "a") as f:
        f.write(line if line.endswith("\n") else line + "\n")
