"""Checkpoints with torch.distributed.checkpoint (DCP): model and optimizer (sharded
models save the same way and reload on another process count), plus our own small files,
none of them pickled: the trainer state and scheduler (JSON), each process's RNG states
(safetensors) and the run's config (TOML).

Layout of a run directory:

    checkpoints/step_00000100/   .metadata, __*_0.distcp (DCP), trainer.json, config.toml,
                                 rng/rank<r>.safetensors, manifest.json (written last)
    checkpoints/.tmp-step_...    a write in progress; renamed to step_... once complete

Every file is fsynced; `manifest.json` (each file's size, and a SHA-256 of every file up to
1 MiB) is written and fsynced last, then the directory is renamed. On load, a checkpoint
whose files do not match its manifest is skipped with a warning and the previous complete
one is used. DCP's `.metadata` (and the optimizer's non-tensor values) are pickled by torch:
load only run directories you trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .collectives import barrier
from .hooks import TrainHooks

DIRNAME = "checkpoints"
MANIFEST = "manifest.json"
HASHED_MAX_BYTES = 1 << 20
_STEP_RE = re.compile(r"^step_(\d{8})$")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    barrier()


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


def _files(ck: Path) -> list[Path]:
    return sorted(p for p in ck.rglob("*") if p.is_file() and p.name != MANIFEST)


def build_manifest(ck: Path, step: int) -> dict:
    files = {}
    for p in _files(ck):
        size = p.stat().st_size
        entry = {"size": size}
        if size <= HASHED_MAX_BYTES:
            entry["sha256"] = _sha256(p)
        files[p.relative_to(ck).as_posix()] = entry
    return {"format": 1, "step": step, "files": files}


def verify_checkpoint(ck: str | Path) -> str | None:
    """None if checkpoint `ck` matches its manifest, else what does not."""
    ck = Path(ck)
    try:
        manifest = json.loads((ck / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST} ({e})"
    for name, entry in files.items():
        p = ck / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != entry["size"]:
            return f"{name} has {p.stat().st_size} bytes, the manifest says {entry['size']}"
        if "sha256" in entry and _sha256(p) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def latest_checkpoint(run_dir: str | Path, verify: bool = True) -> Path | None:
    """The newest complete checkpoint of a run (None if there is none). With `verify`, a
    checkpoint that does not match its manifest is skipped with a warning."""
    for _, ck in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(ck) if verify else None
        if problem is None:
            return ck
        warnings.warn(
            f"skipping checkpoint {str(ck)!r}: {problem}; using the previous complete one",
            stacklevel=2,
        )
    return None


def remove_partial(run_dir: str | Path) -> None:
    """Delete leftovers of interrupted writes (rank 0 only)."""
    root = Path(run_dir) / DIRNAME
    if _rank_world()[0] == 0 and root.is_dir():
        for p in root.glob(".tmp-step_*"):
            shutil.rmtree(p, ignore_errors=True)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_file_mode() -> int:
    """0666 minus this process's umask: the mode `open()` gives a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _rng_tensors() -> tuple[dict, dict]:
    """This process's RNG states as tensors and JSON strings (for safetensors, no pickle)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, mt, py_gauss = random.getstate()
    tensors = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    meta = {
        "numpy": json.dumps([name, int(pos), int(has_gauss), float(gauss)]),
        "python": json.dumps([version, list(mt), py_gauss]),
    }
    return tensors, meta


def _set_rng(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    torch.set_rng_state(tensors["torch"])
    name, pos, has_gauss, gauss = json.loads(meta["numpy"])
    np.random.set_state((name, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, mt, py_gauss = json.loads(meta["python"])
    random.setstate((version, tuple(mt), py_gauss))
    cuda = [tensors[f"cuda{i}"] for i in range(len(tensors)) if f"cuda{i}" in tensors]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    return dcp, sd


def _scheduler_json(scheduler) -> dict:
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


def _prune(run_dir, keep: int) -> None:
    """Keep the newest `keep` checkpoints that match their manifests; delete older ones."""
    valid = 0
    for _, ck in reversed(list_checkpoints(run_dir)):
        if valid >= keep:
            shutil.rmtree(ck, ignore_errors=True)
        elif verify_checkpoint(ck) is None:
            valid += 1


def _options(sd, trainable_only: bool):
    # LoRA runs: the frozen base comes from model.path, only the adapters are saved
    # (strict=False: the frozen keys are absent by design; DCP still fails on a missing adapter)
    if not trainable_only:
        return None
    return sd.StateDictOptions(ignore_frozen_params=True, strict=False)


def save_checkpoint(
    run_dir,
    step: int,
    model,
    optimizer,
    scheduler,
    trainer_state: dict,
    *,
    keep: int,
    config_file: Path | None = None,
    hooks: TrainHooks | None = None,
    trainable_only: bool = False,
) -> Path:
    """Write checkpoint `step` atomically (all processes call this) and keep the last `keep`."""
    from safetensors.torch import save_file

    hooks = hooks or TrainHooks()
    dcp, sd = _dcp()
    rank, _ = _rank_world()
    final = step_dir(run_dir, step)
    tmp = final.with_name(".tmp-" + final.name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    tensors, meta = _rng_tensors()
    rng_file = tmp / "rng" / f"rank{rank}.safetensors"
    save_file(tensors, str(rng_file), metadata=meta)
    os.chmod(rng_file, default_file_mode())  # safetensors creates files 0600
    _fsync_path(rng_file)
    hooks.on_checkpoint("before_shards", step)
    model_sd, optim_sd = sd.get_state_dict(model, optimizer, options=_options(sd, trainable_only))
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to save in a single process"
        )
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    hooks.on_checkpoint("after_shards", step)
    if rank == 0:
        _finish_write(tmp, final, step, scheduler, trainer_state, config_file, hooks)
        _prune(run_dir, keep)
    _barrier()
    if rank != 0:
        hooks.on_checkpoint("after_rename", step)
    return final


def _finish_write(
    tmp: Path, final: Path, step, scheduler, trainer_state, config_file, hooks
) -> None:
    """Rank 0: the small files, fsync everything, the manifest, then the rename."""
    trainer = {"step": step, **trainer_state, "scheduler": _scheduler_json(scheduler)}
    write_synced(tmp / "trainer.json", (json.dumps(trainer, indent=1) + "\n").encode())
    if config_file is not None and Path(config_file).is_file():
        write_synced(tmp / "config.toml", Path(config_file).read_bytes())
    for p in _files(tmp):  # DCP's files (its writer syncs shards; .metadata too, to be sure)
        _fsync_path(p)
    for d in (tmp / "rng", tmp):
        _fsync_path(d)
    hooks.on_checkpoint("before_manifest", step)
    manifest = build_manifest(tmp, step)
    write_synced(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    _fsync_path(tmp)
    hooks.on_checkpoint("before_rename", step)
    if final.exists():  # re-saving the same step (e.g. a resumed run's end)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_path(final.parent)
    hooks.on_checkpoint("after_rename", step)


def read_trainer_state(path: str | Path) -> dict:
    """trainer.json of a checkpoint (step, sample index, scheduler state, ...)."""
    try:
        return json.loads((Path(path) / "trainer.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{str(path)!r} has no readable trainer.json ({e}); pick another checkpoints/step_* directory"
        ) from None


def load_checkpoint(
    path,
    model,
    optimizer=None,
    scheduler=None,
    *,
    restore_rng: bool = True,
    trainable_only: bool = False,
) -> dict:
    """Load a checkpoint into `model` (and `optimizer`, `scheduler`); returns the trainer
    state (trainer.json without the scheduler). trainable_only: the checkpoint holds only
    the parameters that train (LoRA)."""
    dcp, sd = _dcp()
    opts = _options(sd, trainable_only)
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(
            f"{str(path)!r} is not a complete dropless checkpoint (no .metadata); pick a checkpoints/step_* directory"
        )
    trainer = read_trainer_state(path)
    if optimizer is not None:
        model_sd, optim_sd = sd.get_state_dict(model, optimizer, options=opts)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": sd.get_model_state_dict(model, options=opts)}
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to load in a single process"
        )
        dcp.load(state, checkpoint_id=str(path))
    if optimizer is not None:
        sd.set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=opts,
        )
    else:
        sd.set_model_state_dict(model, state["model"], options=opts)
    saved_scheduler = trainer.pop("scheduler", None)
    if scheduler is not None and saved_scheduler is not None:
        scheduler.load_state_dict({**scheduler.state_dict(), **saved_scheduler})
    rng_file = path / "rng" / f"rank{_rank_world()[0]}.safetensors"
    if restore_rng and rng_file.is_file():
        _set_rng(rng_file)
    return trainer
