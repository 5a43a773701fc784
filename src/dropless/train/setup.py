"""Process group, run directory and the checks that fail fast before any long work."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .data import _data_files
from .genomics import DNATokenizer
from .model import check_compatible, hf_config, recipe_context
from .tokenizer import TOKENIZER_FILE, ByteTokenizer, HFTokenizer


@dataclass
class Env:
    """Where this process runs: rank and world (torchrun) and its device."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_env() -> Env:
    """Join the torchrun process group (gloo on CPU, NCCL on GPU) if there is one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if cuda else "gloo", device_id=device if cuda else None
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Env(rank, dist.get_world_size() if dist.is_initialized() else 1, local, device)


def broadcast(obj, env: Env):
    """rank 0's value of `obj` on every process."""
    if env.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def resolve_run_dir(run_dir: str | None, resume: bool, env: Env) -> Path:
    """The run directory: given, or (resume) the newest under runs/, or runs/<timestamp>."""
    if run_dir is None and env.main:
        if resume:
            runs = sorted(
                (p for p in Path("runs").glob("*") if ckpt.latest_checkpoint(p)),
                key=lambda p: p.stat().st_mtime,
            )
            if not runs:
                raise ValueError(
                    "--resume without --run-dir: no run with a checkpoint under ./runs; pass --run-dir RUN_DIR"
                )
            run_dir = str(runs[-1])
        else:
            run_dir = time.strftime("runs/%Y%m%d-%H%M%S")
    return Path(broadcast(run_dir, env))


def check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"the run directory {str(run_dir)!r} is not writable ({e.strerror}); pass --run-dir to a writable directory"
        ) from None


def tokenizer_vocab(cfg, run_dir: Path) -> int:
    """The vocabulary size the run's tokenizer has (or will have once trained)."""
    spec = cfg.data.tokenizer
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


def preflight(cfg, env: Env, run_dir: Path, resume: bool):
    """Every check that needs no long work; returns (hf model config, checkpoint to resume)."""
    recipe_context(cfg.precision)
    from ..parallel.mesh import resolve_sizes

    resolve_sizes(cfg.parallel, env.world, None)  # layout vs world, before any work
    per = env.world * cfg.train.grad_accum
    if cfg.train.batch_size % per:
        raise ValueError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by the number of processes ({env.world}) "
            f"x train.grad_accum ({cfg.train.grad_accum}); use a multiple of {per} (batch_size is the global batch)"
        )
    if env.main:
        check_writable(run_dir)
    if env.world > 1:
        dist.barrier()
    resume_from = None
    if resume:
        resume_from = ckpt.latest_checkpoint(run_dir)
        if resume_from is None:
            raise ValueError(
                f"--resume: {str(run_dir)!r} has no complete checkpoint to resume from; run without --resume to start it"
            )
    elif ckpt.list_checkpoints(run_dir):
        raise ValueError(
            f"{str(run_dir)!r} already holds checkpoints: pass --resume to continue that run, or another --run-dir"
        )
    if cfg.data.path:
        _data_files(cfg.data.path, "data.path")
    if cfg.data.eval_path:
        _data_files(cfg.data.eval_path, "data.eval_path")
    config = hf_config(cfg.model, tokenizer_vocab(cfg, run_dir))
    resolve_sizes(cfg.parallel, env.world, getattr(config, "num_experts", None))
    check_compatible(config, tokenizer_vocab(cfg, run_dir), cfg.train.seq_len)
    if cfg.precision.dtype == "bf16" and env.device.type == "cpu" and env.main:
        print(
            "note: precision.dtype=bf16 on CPU is very slow on CPUs without bf16 matmul units",
            flush=True,
        )
    return config, resume_from
