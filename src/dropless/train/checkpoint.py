"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, scheduler, the
data position (a global sample index, independent of the number of processes) and RNG.

Layout of a run directory:

    checkpoints/step_00000100/   .metadata, __*_0.distcp (DCP), trainer.json, config.toml,
                                 rng/rank<r>.pt (each process's RNG states)
    checkpoints/.tmp-step_...    a write in progress; renamed to step_... once complete

A checkpoint is written under a temporary name and renamed only when every file is in
place, so a crash mid-write leaves the previous checkpoint as the latest complete one.
Model and optimizer state go through `get_state_dict`/`set_state_dict`, so sharded
(FSDP2 / expert-parallel) models save the same way and reload on another process count.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

DIRNAME = "checkpoints"
_STEP_RE = re.compile(r"^step_(\d{8})$")
KILL_HOOK_ENV = "DROPLESS_TEST_KILL_AFTER_FIRST_FILE"


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / DIRNAME / f"step_{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first, as (step, path)."""
    root = Path(run_dir) / DIRNAME
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (p / ".metadata").is_file() and (p / "trainer.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (None if there is none)."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def remove_partial(run_dir: str | Path) -> None:
    """Delete leftovers of interrupted writes (rank 0 only)."""
    root = Path(run_dir) / DIRNAME
    if _rank_world()[0] == 0 and root.is_dir():
        for p in root.glob(".tmp-step_*"):
            shutil.rmtree(p, ignore_errors=True)


def _rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _test_kill_hook(step: int) -> None:
    """Tests: SIGKILL this process after the first file of checkpoint `step` is written."""
    if os.environ.get(KILL_HOOK_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    return dcp, sd


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
    trainable_only: bool = False,
) -> Path:
    """Write checkpoint `step` atomically (all processes call this) and keep the last `keep`."""
    dcp, sd = _dcp()
    rank, _ = _rank_world()
    final = step_dir(run_dir, step)
    tmp = final.with_name(".tmp-" + final.name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    _test_kill_hook(step)
    model_sd, optim_sd = sd.get_state_dict(model, optimizer, options=_options(sd, trainable_only))
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "scheduler": scheduler.state_dict(),
        "trainer": dict(trainer_state),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to save in a single process"
        )
        dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if rank == 0:
        (tmp / "trainer.json").write_text(
            json.dumps({"step": step, **trainer_state}, indent=1) + "\n"
        )
        if config_file is not None and config_file.is_file():
            shutil.copy2(config_file, tmp / "config.toml")
        if final.exists():  # re-saving the same step (e.g. a resumed run's end)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


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
    state. trainable_only: the checkpoint holds only the parameters that train (LoRA)."""
    dcp, sd = _dcp()
    opts = _options(sd, trainable_only)
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(
            f"{str(path)!r} is not a complete dropless checkpoint (no .metadata); pick a checkpoints/step_* directory"
        )
    trainer = json.loads((path / "trainer.json").read_text())
    trainer.pop("step", None)
    if optimizer is not None:
        model_sd, optim_sd = sd.get_state_dict(model, optimizer, options=opts)
        state = {"model": model_sd, "optim": optim_sd, "trainer": dict(trainer)}
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
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
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        trainer = state["trainer"]
    else:
        sd.set_model_state_dict(model, state["model"], options=opts)
    rng_file = path / "rng" / f"rank{_rank_world()[0]}.pt"
    if restore_rng and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer
