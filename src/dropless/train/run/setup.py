"""The process: the torchrun group (or none), its rank, world and device, and the helpers
that run a function on rank 0 and hand every rank the result."""

from __future__ import annotations

import atexit
import gc
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .collectives import broadcast_object


@dataclass
class Env:
    """Where this process runs: rank and world (torchrun) and its device."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    #: the run takes the parallel path (FSDP2, DTensor experts): several processes, or one
    #: under parallel.force_distributed
    distributed: bool = False
    #: rank 0: the process that writes the run's files and prints
    main: bool = field(init=False)

    def __post_init__(self) -> None:
        self.main = self.rank == 0


def init_env(timeout_s: float = 1800.0, force_distributed: bool = False) -> Env:
    """Join the torchrun process group (gloo on CPU, NCCL on GPU) if there is one; every
    collective (the wait while rank 0 prepares the data included) is bounded by `timeout_s`.
    force_distributed (parallel.force_distributed): one process joins a 1-process group too
    (torchrun's, or an in-memory one without torchrun), so the run takes the parallel path."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if (world > 1 or force_distributed) and not dist.is_initialized():
        atexit.register(close_env)
        # no torchrun: a store in this process's memory serves a group of one
        store = (
            {}
            if "MASTER_ADDR" in os.environ
            else dict(store=dist.HashStore(), rank=0, world_size=1)
        )
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            device_id=device if cuda else None,
            timeout=timedelta(seconds=timeout_s),
            **store,
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return Env(rank, world, local, device, distributed=world > 1 or force_distributed)


def _release_dtensor_caches() -> None:
    """Empty torch's DTensor caches whose entries hold DeviceMesh objects strongly (sharding
    propagation, redistribute plans and transforms, mesh topology): a mesh keeps its
    process groups, and so their worker threads, alive. Each is looked up by name, as
    torch versions differ; `tests/train/test_clean_exit.py` fails if one is left holding them."""
    import importlib

    def call(module: str, path: str) -> None:
        try:
            obj = importlib.import_module(module)
            for name in path.split("."):
                obj = getattr(obj, name)
        except (ImportError, AttributeError):
            return
        obj()

    tensor = "torch.distributed.tensor"
    call(f"{tensor}.debug", "_clear_sharding_prop_cache")
    call(f"{tensor}._redistribute", "clear_redistribute_planner_cache")
    call(f"{tensor}._redistribute", "_gen_transform_infos.cache_clear")
    call(f"{tensor}._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear")
    call(f"{tensor}._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached.cache_clear")


def close_env() -> None:
    """Leave the process group so that none of its threads outlives the interpreter.

    A gloo (or NCCL) worker thread releases the tensors of the last collective it ran
    after the caller's wait() returned; releasing them takes the GIL. If that happens
    once Python is finalizing, the thread is made to exit inside a C++ destructor and
    the process aborts ("terminate called without an active exception", SIGABRT after
    a finished run). So the groups are destroyed here, every reference torch keeps to
    their device meshes is dropped and the cycles are collected: the groups' C++
    destructors then join their threads while Python still runs. Called at the end of
    `train` and again at interpreter exit (atexit runs before finalization), which
    covers an error whose traceback kept the model, and so the meshes, alive."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _release_dtensor_caches()
    gc.collect()


def broadcast(obj, env: Env):
    """rank 0's value of `obj` on every process (through the group under
    parallel.force_distributed too, as on a node)."""
    if env.world == 1 and not env.distributed:
        return obj
    return broadcast_object(obj, src=0)


def rank0_only(fn, env: Env):
    """`fn()` on rank 0 (None elsewhere); a user error (ValueError/OSError) there is raised
    on every rank, so no process waits at a collective that never comes."""
    result, err = None, None
    if env.main:
        try:
            result = fn()
        except (ValueError, OSError) as e:
            err = e
    msg = broadcast(None if err is None else str(err), env)
    if err is not None:
        raise err
    if msg is not None:  # rank 0 failed: every rank stops with its message
        raise ValueError(msg)
    return result


def on_rank0(fn, env: Env):
    """`fn()` on rank 0, its result on every rank (see `rank0_only`)."""
    return broadcast(rank0_only(fn, env), env)
