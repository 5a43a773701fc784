"""Checkpoints with torch.distributed.checkpoint (DCP) plus our own small files, none of
them pickled (docs/train.md, *Checkpoints and resume*, gives the layout and the order of
the writes). DCP's `.metadata` is a pickle: it is read with an unpickler that admits only
DCP's own metadata classes. A checkpoint is still code you trust: whoever can write it can
also rewrite its manifest. Listing, manifests, verification and the readers' hold live in
`manifest.py`; pruning here skips a checkpoint a reader holds.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..run.atomic import fsync_path, naming, run_dir_vanished
from ..run.collectives import barrier
from ..run.hooks import TrainHooks
from .dcp_io import SafeReader, hashing_writer, load_metadata
from .manifest import (  # re-exported: callers name them as store.*
    DIRNAME,
    MANIFEST,
    build_manifest,
    checkpoint_files,
    damaged_checkpoints,
    hold,
    latest_checkpoint,
    list_checkpoints,
    open_locked,
    pick_checkpoint,
    release,
    step_dir,
    verify_checkpoint,
)

DIGESTS = "digests"  # each process's digests of the shards it wrote, for the manifest


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def remove_partial(run_dir: str | Path) -> None:
    """Delete leftovers of interrupted writes (rank 0 only)."""
    root = Path(run_dir) / DIRNAME
    if _rank_world()[0] == 0 and root.is_dir():
        for p in root.glob(".tmp-step_*"):
            shutil.rmtree(p, ignore_errors=True)


def default_file_mode() -> int:
    """0666 minus this process's umask: the mode `open()` gives a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_synced(path: Path, data: bytes) -> str:
    """Write `data` to `path` (a new file: never through a symlink), fsync it; its SHA-256."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    with naming(path), os.fdopen(fd, "wb") as f:  # a full disk's error names the file
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


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


def _delete(ck: Path) -> None:
    """Remove checkpoint `ck` unless a reader holds it (then a later save prunes it)."""
    fd = open_locked(ck, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if fd is None:
        return
    try:  # renamed under the lock: a reader that opens the manifest next finds it gone
        gone = ck.with_name(f".tmp-{ck.name}-pruned")
        os.replace(ck, gone)
    except OSError:
        os.close(fd)
        return
    os.close(fd)
    shutil.rmtree(gone, ignore_errors=True)


def _prune(run_dir, keep: int) -> None:
    """Keep the newest `keep` checkpoints that match their manifests; delete older ones."""
    valid = 0
    for _, ck in reversed(list_checkpoints(run_dir)):
        if valid >= keep:
            _delete(ck)
        elif verify_checkpoint(ck) is None:
            valid += 1


def _options(sd, trainable_only: bool):
    # LoRA runs: the frozen base comes from model.path, only the adapters are saved
    # (strict=False: the frozen keys are absent by design; DCP still fails on a missing adapter)
    if not trainable_only:
        return None
    return sd.StateDictOptions(ignore_frozen_params=True, strict=False)


def raise_os_error(fs) -> None:
    """Raise a failed DCP write's first OSError (a full disk, a read-only file system),
    when there is one, instead of the serializer's message."""
    if fs.errors:
        raise fs.errors[0] from None


def shard_digests(fs, tmp: Path) -> dict[str, str]:
    """The shards' digests (name relative to `tmp` -> SHA-256) of a DCP write into `tmp`."""
    return {Path(k).relative_to(tmp).as_posix(): v for k, v in fs.digests.items()}


def _write_shards(state: dict, tmp: Path) -> dict[str, str]:
    """DCP save into `tmp`; the shards' digests (relative name -> SHA-256)."""
    dcp, _ = _dcp()
    writer, fs = hashing_writer(tmp)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to save in a single process"
        )
        try:
            dcp.save(state, checkpoint_id=str(tmp), storage_writer=writer)
        except BaseException:  # DCP's CheckpointException is a BaseException
            raise_os_error(fs)
            raise
    return shard_digests(fs, tmp)


@dataclass
class SaveRequest:
    """What one checkpoint save writes, and where: the step's model, optimizer, scheduler
    and trainer state under `run_dir`, keeping the last `keep` checkpoints, with the run's
    `config_file` beside them; `trainable_only` (LoRA) saves only the trainable tensors.
    The one signature of `save_checkpoint`, `begin_save` and `CheckpointSaver.save`."""

    run_dir: Path | str
    step: int
    model: Any
    optimizer: Any
    scheduler: Any
    trainer_state: dict
    keep: int
    config_file: Path | None = None
    hooks: TrainHooks | None = None
    trainable_only: bool = False


@dataclass
class SaveJob:
    """A checkpoint begun by `begin_save`: its temporary folder holds the RNG files; the
    shards are still to be written (from `state`), then `commit_save` finishes it. What
    trainer.json and config.toml will hold is taken when the save begins, so training may
    go on while the shards are written."""

    run_dir: Path
    step: int
    tmp: Path
    final: Path
    state: dict | None  # DCP's {"model", "optim"} of live tensors (dropped once staged)
    trainer: dict
    config: bytes | None
    keep: int
    hooks: TrainHooks


def begin_save(req: SaveRequest) -> SaveJob:
    """The first part of a save (all processes call it): the temporary folder, this
    process's RNG file, the state dicts and the small files' contents."""
    from safetensors.torch import save

    run_dir, step, config_file = req.run_dir, req.step, req.config_file
    hooks = req.hooks or TrainHooks()
    _, sd = _dcp()
    rank, _ = _rank_world()
    final = step_dir(run_dir, step)
    tmp = final.with_name(".tmp-" + final.name)
    if rank == 0:
        if not Path(run_dir).is_dir():
            raise run_dir_vanished(Path(run_dir))
        # never its parents: a vanished run is not recreated
        (Path(run_dir) / DIRNAME).mkdir(exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        (tmp / "rng").mkdir()
        (tmp / DIGESTS).mkdir()
    barrier()
    tensors, meta = _rng_tensors()
    rng_file = tmp / "rng" / f"rank{rank}.safetensors"
    # serialized here, written and synced by write_synced: a failed write raises
    write_synced(rng_file, save(tensors, metadata=meta))
    hooks.on_checkpoint("before_shards", step)
    options = _options(sd, req.trainable_only)
    model_sd, optim_sd = sd.get_state_dict(req.model, req.optimizer, options=options)
    trainer = {
        "step": step,
        **req.trainer_state,
        "scheduler": {k: v for k, v in req.scheduler.state_dict().items() if k != "lr_lambdas"},
    }
    config = None
    if rank == 0 and config_file is not None and Path(config_file).is_file():
        config = Path(config_file).read_bytes()
    state = {"model": model_sd, "optim": optim_sd}
    return SaveJob(Path(run_dir), step, tmp, final, state, trainer, config, req.keep, hooks)


def commit_save(job: SaveJob, digests: dict[str, str], group=None) -> Path:
    """The rest of a save, once this process's shards are written (all processes call it;
    `group`: the process group its barriers run on): the digests, rank 0's small files,
    manifest and rename, then pruning; the checkpoint's final path."""
    rank, _ = _rank_world()
    write_synced(job.tmp / DIGESTS / f"rank{rank}.json", json.dumps(digests).encode())
    barrier(group)
    job.hooks.on_checkpoint("after_shards", job.step)
    if rank == 0:
        _finish_write(job)
        _prune(job.run_dir, job.keep)
    barrier(group)
    if rank != 0:
        job.hooks.on_checkpoint("after_rename", job.step)
    return job.final


def save_checkpoint(req: SaveRequest) -> Path:
    """Write checkpoint `req.step` atomically (all processes call this) and keep the last
    `req.keep`; returns once it is complete (`async_save.CheckpointSaver` overlaps the
    writes with training)."""
    job = begin_save(req)
    digests = _write_shards(job.state, job.tmp)
    job.state = None
    return commit_save(job, digests)


def _finish_write(job: SaveJob) -> None:
    """Rank 0: the small files, fsync everything, the manifest, then the rename."""
    tmp, final, step, hooks = job.tmp, job.final, job.step, job.hooks
    digests = {}
    for f in sorted((tmp / DIGESTS).glob("rank*.json")):
        digests.update(json.loads(f.read_text()))
    data = (json.dumps(job.trainer, indent=1) + "\n").encode()
    digests["trainer.json"] = write_synced(tmp / "trainer.json", data)
    if job.config is not None:
        digests["config.toml"] = write_synced(tmp / "config.toml", job.config)
    # DCP's files (its writer syncs shards; .metadata too, to be sure)
    for p in checkpoint_files(tmp):
        fsync_path(p)
    for d in (tmp / "rng", tmp / DIGESTS, tmp):
        fsync_path(d)
    hooks.on_checkpoint("before_manifest", step)
    manifest = build_manifest(tmp, step, digests)
    write_synced(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    fsync_path(tmp)
    hooks.on_checkpoint("before_rename", step)
    if final.exists():  # re-saving the same step (e.g. a resumed run's end)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(final.parent)
    hooks.on_checkpoint("after_rename", step)


#: trainer.json fields a resume reads, and the smallest value each may take
_COUNTERS = {
    "step": 0,
    "sample_index": 0,
    "skipped_steps": 0,
    "skipped_in_a_row": 0,
    "world_size": 1,
}


def _check_trainer(path: Path, d) -> dict:
    def bad(what: str) -> ValueError:
        return ValueError(
            f"{str(path / 'trainer.json')!r}: {what}; the checkpoint is damaged or was edited: "
            "pick another checkpoints/step_* directory"
        )

    if not isinstance(d, dict):
        raise bad(f"expected a JSON object, found {type(d).__name__}")
    for key, low in _COUNTERS.items():
        v = d.get(key, low)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise bad(f"{key} is {v!r}, expected an integer >= {low}")
    for key in ("initial_eval_loss", "initial_eval_bpb"):
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise bad(f"{key} is {v!r}, expected a number or null")
    if not isinstance(d.get("scheduler", {}), dict):
        raise bad(f"scheduler is {d['scheduler']!r}, expected a JSON object")
    return d


def read_trainer_state(path: str | Path) -> dict:
    """trainer.json of a checkpoint (step, sample index, scheduler state, ...)."""
    try:
        d = json.loads((Path(path) / "trainer.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{str(path)!r} has no readable trainer.json ({e}); pick another checkpoints/step_* directory"
        ) from None
    return _check_trainer(Path(path), d)


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
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(
            f"{str(path)!r} is not a complete dropless checkpoint (no .metadata); pick a checkpoints/step_* directory"
        )
    try:
        if not hold(path):
            raise ValueError(
                f"checkpoint {str(path)!r} has no {MANIFEST} (or was removed while opening it); "
                "pick another checkpoints/step_* directory"
            )
        problem = verify_checkpoint(path)  # before any of it is unpickled
        if problem is not None:
            raise ValueError(
                f"checkpoint {str(path)!r} does not verify: {problem}; pick another checkpoints/step_* directory"
            )
        return _load(path, model, optimizer, scheduler, restore_rng, trainable_only)
    finally:  # held from the pick (or here) until loaded
        release(path)


def _load(path: Path, model, optimizer, scheduler, restore_rng: bool, trainable_only: bool):
    dcp, sd = _dcp()
    opts = _options(sd, trainable_only)
    trainer = read_trainer_state(path)
    load_metadata(path / ".metadata")  # a refused pickle as a ValueError, not inside DCP's error
    if optimizer is not None:
        model_sd, optim_sd = sd.get_state_dict(model, optimizer, options=opts)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": sd.get_model_state_dict(model, options=opts)}
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to load in a single process"
        )
        dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)))
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


__all__ = [
    "DIRNAME", "MANIFEST", "SaveJob", "SaveRequest", "begin_save", "build_manifest", "commit_save",
    "damaged_checkpoints", "default_file_mode", "hold", "latest_checkpoint", "list_checkpoints",
    "load_checkpoint", "pick_checkpoint", "read_trainer_state", "release", "remove_partial",
    "raise_os_error", "save_checkpoint", "shard_digests", "step_dir",
    "verify_checkpoint", "write_synced",
]  # fmt: skip
