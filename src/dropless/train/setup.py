"""Process group, run directory and the checks that fail fast before any long work."""

from __future__ import annotations

import atexit
import gc
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .collectives import broadcast_object
from .data import _data_files
from .genomics import DNATokenizer
from .model import check_compatible, hf_config, recipe_context
from .resume import check_fresh_start, check_resume, no_resume_point
from .rundir import new_run_dir
from .tokenizer import TOKENIZER_FILE, ByteTokenizer, HFTokenizer, resolve_spec


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

    @property
    def main(self) -> bool:
        return self.rank == 0


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


def rank0_first(fn, env: Env):
    """`fn()` on rank 0, then (once it succeeded) on the other ranks, which read the cache
    it filled. The wait is a collective bounded by parallel.timeout_s."""
    result = rank0_only(fn, env)
    return result if env.main else fn()


def latest_run(root: str | Path = "runs") -> Path:
    """The run under `root` whose newest checkpoint was written last."""
    found = [
        (p, ckpt.latest_checkpoint(p, verify=False)) for p in Path(root).glob("*") if p.is_dir()
    ]
    found = [(p, c) for p, c in found if c is not None]
    if not found:
        raise ValueError(
            f"--resume without --run-dir: no run with a checkpoint under ./{root}; pass --run-dir RUN_DIR"
        )
    return max(found, key=lambda pc: pc[1].stat().st_mtime)[0]


def resolve_run_dir(run_dir: str | None, resume: bool, env: Env) -> Path:
    """The run directory: given, or (resume) the newest under runs/, or a new runs/<timestamp>."""
    if run_dir is None:
        run_dir = on_rank0(lambda: str(latest_run() if resume else new_run_dir()), env)
    return Path(run_dir)


def tokenizer_vocab(cfg, run_dir: Path) -> int:
    """The vocabulary size the run's tokenizer has (or will have once trained)."""
    spec = resolve_spec(cfg.data.tokenizer, cfg.model.path)
    if spec == "bytes":
        return ByteTokenizer.vocab_size
    if spec == "dna":
        return DNATokenizer.vocab_size
    if spec == "bpe":
        cached = run_dir / "tokenizer"
        return (
            HFTokenizer.from_dir(cached).vocab_size
            if (cached / TOKENIZER_FILE).is_file()
            else cfg.data.bpe_vocab_size
        )
    if not Path(spec).is_dir():
        raise ValueError(
            f"data.tokenizer={spec!r}: not 'bpe', 'bytes', 'dna' or an existing tokenizer directory"
        )
    return HFTokenizer.from_dir(spec).vocab_size


def warn_all_warmup(cfg) -> None:
    """A run no longer than its warmup never leaves it: the learning rate only rises (to
    train.steps / optim.warmup_steps of optim.lr) and optim.schedule never applies."""
    steps, warmup = cfg.train.steps, cfg.optim.warmup_steps
    if warmup and steps <= warmup:
        warnings.warn(
            f"train.steps={steps} <= optim.warmup_steps={warmup}: the whole run is warmup (the learning "
            f"rate reaches {steps / warmup:.0%} of optim.lr and optim.schedule never applies); lower "
            f"optim.warmup_steps (e.g. --set optim.warmup_steps={max(1, steps // 10)}) or raise train.steps",
            stacklevel=2,
        )


def preflight(cfg, env: Env, run_dir: Path, resume: bool):
    """Every check that needs no long work; returns (hf model config, checkpoint to resume)."""
    recipe_context(cfg.precision)
    from ..parallel.mesh import resolve_sizes

    resume_from = None
    if resume:
        resume_from = on_rank0(lambda: ckpt.latest_checkpoint(run_dir), env)
        if resume_from is None:
            raise no_resume_point(run_dir)
        check_resume(cfg, resume_from, env.world)
    else:
        check_fresh_start(run_dir)
    resolve_sizes(cfg.parallel, env.world, None)  # layout vs world, before any work
    if cfg.finetune.method == "lora":
        from .lora import require_peft

        require_peft()
    per = env.world * cfg.train.grad_accum
    if cfg.train.batch_size % per:
        raise ValueError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by the number of processes ({env.world}) "
            f"x train.grad_accum ({cfg.train.grad_accum}); use a multiple of {per} (batch_size is the global batch)"
        )
    if cfg.data.path:
        _data_files(cfg.data.path, "data.path")
    if cfg.data.eval_path:
        _data_files(cfg.data.eval_path, "data.eval_path")
    vocab = tokenizer_vocab(cfg, run_dir)
    config = hf_config(cfg.model, vocab)
    resolve_sizes(cfg.parallel, env.world, getattr(config, "num_experts", None))
    check_compatible(config, vocab, cfg.train.seq_len, pretrained=bool(cfg.model.path))
    from .memory_fit import check_fits_memory

    check_fits_memory(cfg, config, env.world, env.device)  # before the model is built
    from .plan_preflight import check_plan_fits

    # CUDA only: the traced plan (under torchrun rank 0 plans in a child process)
    check_plan_fits(cfg, config, env.world, env.device, lambda fn: on_rank0(fn, env))
    if env.main:
        warn_all_warmup(cfg)
    if cfg.precision.dtype == "bf16" and env.device.type == "cpu" and env.main:
        print(
            "note: precision.dtype=bf16 on CPU is very slow on CPUs without bf16 matmul units",
            flush=True,
        )
    return config, resume_from
