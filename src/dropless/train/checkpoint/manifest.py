"""Which checkpoints a run directory holds and whether each is whole: the step
directories (`step_{:08d}`, nine digits from step 10^8 on, ordered by number), the
manifest (every file's size and SHA-256) and its verification, and the shared `flock` a
reader (`dropless generate` / `convert`) holds on the manifest of the checkpoint it picked
until it is loaded (pruning, in `store.py`, skips a held checkpoint)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import warnings
from pathlib import Path

DIRNAME = "checkpoints"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2  # format 1 hashed only files up to 1 MiB
_STEP_RE = re.compile(r"^step_(\d{8,})$")  # step_{:08d}: 9 digits from step 10^8 on


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / DIRNAME / f"step_{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Checkpoints of a run that have a manifest, oldest first, as (step, path)."""
    root = Path(run_dir) / DIRNAME
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_files(ck: Path) -> list[Path]:
    return sorted(p for p in ck.rglob("*") if p.is_file() and p.name != MANIFEST)


def build_manifest(ck: Path, step: int, digests: dict[str, str] | None = None) -> dict:
    """Size and SHA-256 of every file of `ck`; `digests` ({relative name: sha256}, taken
    while the files were written) spares reading them again."""
    digests = digests or {}
    files = {}
    for p in checkpoint_files(ck):
        name = p.relative_to(ck).as_posix()
        files[name] = {"size": p.stat().st_size, "sha256": digests.get(name) or _sha256(p)}
    return {"format": MANIFEST_FORMAT, "step": step, "files": files}


def _stat_key(ck: Path) -> tuple:
    """What a verification result depends on: every file's identity, size and mtime."""
    return tuple(
        (p.relative_to(ck).as_posix(), s.st_ino, s.st_size, s.st_mtime_ns)
        for p in sorted(ck.rglob("*"))
        if p.is_file() and (s := p.stat())
    )


_verified: dict[Path, tuple] = {}  # checkpoint -> _stat_key when it last verified


def _check(ck: Path) -> str | None:
    try:
        manifest = json.loads((ck / MANIFEST).read_text())
        files = manifest["files"]
        fmt = manifest.get("format", 1)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {MANIFEST} ({e})"
    if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
        return f"unreadable {MANIFEST} (its 'files' is not a table of tables)"
    for name, entry in files.items():
        p = ck / name
        if not p.is_file() or p.is_symlink():
            return f"file {name} is missing"
        if p.stat().st_size != entry.get("size"):
            return (
                f"file {name} has {p.stat().st_size} bytes, the manifest says {entry.get('size')}"
            )
        if "sha256" not in entry and fmt >= 2:
            return f"file {name} has no checksum in {MANIFEST}"
        if "sha256" in entry and _sha256(p) != entry["sha256"]:
            return f"file {name} does not match its checksum"
    return None


def verify_checkpoint(ck: str | Path) -> str | None:
    """None if every file of checkpoint `ck` matches its manifest, else what does not
    (one line naming the file). A checkpoint unchanged since it last verified in this
    process is not read again."""
    ck = Path(ck)
    key = _stat_key(ck) if ck.is_dir() else None
    if key is not None and _verified.get(ck) == key:
        return None
    problem = _check(ck)
    if problem is None and key is not None:
        _verified[ck] = key
    return problem


def skipped_warning(ck: Path, problem: str, fallback: Path | None) -> str:
    then = (
        f"using the previous complete one, {fallback.name}"
        if fallback is not None
        else "no older checkpoint verifies"
    )
    return f"skipping checkpoint {str(ck)!r}: {problem}; {then}"


def latest_checkpoint(run_dir: str | Path, verify: bool = True) -> Path | None:
    """The newest complete checkpoint of a run (None if there is none). With `verify`, a
    checkpoint that does not match its manifest is skipped with a warning."""
    skipped = []
    found = None
    for _, ck in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(ck) if verify else None
        if problem is None:
            found = ck
            break
        skipped.append((ck, problem))
    for ck, problem in skipped:
        warnings.warn(skipped_warning(ck, problem, found), stacklevel=2)
    return found


def damaged_checkpoints(run_dir: str | Path) -> list[str]:
    """'step_N: problem' for each checkpoint of a run that does not verify."""
    out = []
    for _, ck in list_checkpoints(run_dir):
        problem = verify_checkpoint(ck)
        if problem is not None:
            out.append(f"{ck.name}: {problem}")
    return out


# ---- readers hold the checkpoint they load; pruning leaves a held one alone -------------

_held: dict[Path, int] = {}  # checkpoint -> descriptor of its manifest under a shared flock


def open_locked(ck: Path, how: int) -> int | None:
    """A descriptor of `ck`'s manifest locked with `how`; None when the checkpoint is gone
    (pruned) or, with LOCK_NB, held by someone else."""
    try:
        fd = os.open(ck / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            raise
        except OSError:
            pass  # no flock on this file system: read without the hold
        held, now = os.fstat(fd), os.stat(ck / MANIFEST)
        if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
            return fd
    except OSError:
        pass
    os.close(fd)  # moved away for pruning while we waited
    return None


def hold(ck: str | Path) -> bool:
    """Hold checkpoint `ck` against pruning until `release(ck)`; False if it is gone."""
    ck = Path(ck)
    if ck in _held:
        return True
    fd = open_locked(ck, fcntl.LOCK_SH)
    if fd is None:
        return False
    _held[ck] = fd
    return True


def release(ck: str | Path) -> None:
    fd = _held.pop(Path(ck), None)
    if fd is not None:
        os.close(fd)


def pick_checkpoint(path: str | Path) -> tuple[Path, Path] | None:
    """(run directory, checkpoint) to load for `path`, a run directory or one of its
    checkpoints/step_* directories, held (`hold`) and verified. A checkpoint given by
    name must verify (ValueError naming the file); for a run directory the newest one
    that verifies is used, the next newest when pruning removes it first. None: the run
    has no checkpoint."""
    p = Path(path)
    if (p / ".metadata").is_file() or (p / MANIFEST).is_file():
        problem = verify_checkpoint(p) if hold(p) else f"{MANIFEST} is missing"
        if problem is not None:
            release(p)
            raise ValueError(
                f"checkpoint {str(p)!r} does not verify: {problem}; it was damaged or changed after it was "
                "written: pass an older checkpoints/step_* directory, or the run directory (its newest "
                "checkpoint that verifies is used)"
            )
        return p.parent.parent, p
    skipped, found = [], None
    for _, ck in reversed(list_checkpoints(p)):
        if not hold(ck):
            continue  # pruned since it was listed: the next newest
        problem = verify_checkpoint(ck)
        if problem is None:
            found = ck
            break
        release(ck)
        skipped.append((ck, problem))
    for ck, problem in skipped:
        warnings.warn(skipped_warning(ck, problem, found), stacklevel=2)
    return None if found is None else (p, found)
