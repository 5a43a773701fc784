"""`dropless train`'s preflight: every check of the config that needs no long work, run once
the run directory is claimed and its contents checked (`claim` of `run/rundir.py`, with
`check_run_dir` of `checkpoint/resume.py` under its lock). `preflight` runs them in order;
on GPUs the last one is the plan of the run's own layout (`trace.py`), refused before any
weight is loaded when it predicts an out-of-memory, with the single changes the plan
predicts would fit."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.corpus import data_files, micro_batch_size
from ..data.tokenizer import vocab_size
from ..model.build import model_config
from ..run.setup import Env, on_rank0
from .trace import GIB, make_plan


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


def preflight(cfg, env: Env, run_dir: Path, vocab: int | None = None):
    """Every check of the config that needs no long work; returns the hf model config.
    `vocab`: the tokenizer's vocabulary (`tokenizer.resolve`), else asked of `vocab_size`.
    (The precision recipe is checked where it is built, `model/precision.py`.)"""
    from ...parallel.mesh import resolve_sizes

    resolve_sizes(cfg.parallel, env.world, None)  # layout vs world, before any work
    if cfg.finetune.method == "lora":
        from ..model.lora import require_peft

        require_peft()
    cp = cfg.parallel.cp  # the cp ranks of one group read the same sequences
    per = env.world // cp * cfg.train.grad_accum
    if cfg.train.batch_size % per and cp == 1:
        raise ValueError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by the number of processes ({env.world}) "
            f"x train.grad_accum ({cfg.train.grad_accum}); use a multiple of {per} (batch_size is the global batch)"
        )
    if cfg.train.batch_size % per:
        raise ValueError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by the number of context-parallel "
            f"groups (world {env.world} / parallel.cp {cp}) x train.grad_accum ({cfg.train.grad_accum}); "
            f"use a multiple of {per} (batch_size is the global batch; the cp ranks of a group share its sequences)"
        )
    if cp > 1:
        from ...parallel.context.sharding import check_seq_len

        check_seq_len(cfg.train.seq_len, cp)  # each rank holds 2 of 2 x cp equal chunks
    if cfg.data.path:
        data_files(cfg.data.path, "data.path")
    if cfg.data.eval_path:
        data_files(cfg.data.eval_path, "data.eval_path")
    if vocab is None:
        vocab = vocab_size(cfg, run_dir)
    config = model_config(cfg.model, vocab, cfg.train.seq_len)
    resolve_sizes(cfg.parallel, env.world, getattr(config, "num_experts", None))
    from .memory_fit import check_fits_memory

    check_fits_memory(cfg, config, env.world, env.device)  # before the model is built
    # CUDA only: the traced plan (under torchrun rank 0 plans in a child process)
    check_plan_fits(cfg, config, env.world, env.device, lambda fn: on_rank0(fn, env))
    if env.main:
        warn_all_warmup(cfg)
    if cfg.precision.dtype == "bf16" and env.device.type == "cpu" and env.main:
        print(
            "note: precision.dtype=bf16 on CPU is very slow on CPUs without bf16 matmul units",
            flush=True,
        )
    return config


def _suggestions(cfg, gpus: int, gpu_memory_gib: float, hf_config) -> list[str]:
    """The single-key changes that the plan predicts would fit."""
    tc, found, cands = cfg.train, [], []
    if not tc.activation_checkpointing:
        cands.append(
            ("train.activation_checkpointing=true", {"train": {"activation_checkpointing": True}})
        )
    if micro_batch_size(tc.batch_size, gpus // cfg.parallel.cp, tc.grad_accum) > 1:
        cands.append(
            (f"train.grad_accum={2 * tc.grad_accum}", {"train": {"grad_accum": 2 * tc.grad_accum}})
        )
    E = int(getattr(hf_config, "num_experts", 0) or 0)
    ep2 = 2 * cfg.parallel.ep
    if ep2 <= gpus and E % ep2 == 0 and gpus % ep2 == 0:
        cands.append((f"parallel.ep={ep2}", {"parallel": {"ep": ep2}}))
    if cfg.finetune.method != "lora" and cfg.model.path:  # LoRA adapts a checkpoint
        cands.append(("finetune.method=lora", {"finetune": {"method": "lora"}}))
    for label, change in cands:
        try:
            c = cfg
            for sec, kv in change.items():
                c = dataclasses.replace(c, **{sec: dataclasses.replace(getattr(c, sec), **kv)})
            p = make_plan(c, gpus, gpu_memory_gib, hf_config=hf_config, compare_checkpointing=False)
        except (ValueError, RuntimeError, NotImplementedError):
            continue
        if p.fits:
            found.append(f"{label} ({_gib(p.peak_gib_per_gpu + p.reserve_gib)} GiB)")
    return found


def _gib(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def device_memory_gib(device: torch.device) -> float:
    return torch.cuda.get_device_properties(device).total_memory / GIB


def verdict(cfg, hf_config, world: int, gib: float) -> dict:
    """The preflight's reading of the plan: fits, the figures, and the changes that would."""
    # a copy: building the planned model sets its experts implementation on the config
    hf_config = copy.deepcopy(hf_config)
    p = make_plan(cfg, world, gib, hf_config=hf_config, compare_checkpointing=False)
    fixes = [] if p.fits else _suggestions(cfg, world, gib, hf_config)
    return {
        "fits": p.fits, "peak": p.peak_gib_per_gpu, "reserve": p.reserve_gib,
        "breakdown": p.breakdown_gib, "fixes": fixes,
    }  # fmt: skip


def verdict_in_child(cfg, hf_config, world: int, gib: float) -> dict:
    """`verdict` in a fresh Python process, handed the config objects themselves (pickled,
    nothing dumped and parsed again): one already in a process group (torchrun) cannot start
    the fake one the plan shards over. A failure there is returned, not raised: every rank
    must get an answer (`on_rank0`)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(verdict, cfg, hf_config, world, gib).result()
    except Exception as e:  # noqa: BLE001  (the child's error, whatever it is, becomes the answer)
        return {"error": f"the plan's process failed: {type(e).__name__}: {e}"}


def check_plan_fits(cfg, hf_config, world: int, device: torch.device, on_rank0=None) -> None:
    """`dropless train`'s preflight on GPUs: refuse (ValueError naming what would fit) a
    layout the plan predicts runs out of memory, before any weight is loaded. CPU runs and
    train.preflight=false skip it. Under torchrun rank 0 plans in a child process
    (`on_rank0(fn)` runs fn there and hands every rank its result). A plan that cannot be
    made (a model the fake tensors cannot trace) warns and lets the run go on: the real
    build reports its own problems."""
    if device.type != "cuda" or not getattr(cfg.train, "preflight", True):
        return
    gib = device_memory_gib(device)
    try:
        if dist.is_initialized():
            run = on_rank0 or (lambda fn: fn())
            v = run(lambda: verdict_in_child(cfg, hf_config, world, gib))
        else:
            v = verdict(cfg, hf_config, world, gib)
    except (RuntimeError, NotImplementedError, TypeError, AssertionError) as e:
        warnings.warn(f"dropless: no memory plan for this run ({type(e).__name__}: {e}); train.preflight skipped", stacklevel=2)  # fmt: skip
        return
    if "error" in v:
        warnings.warn(f"dropless: no memory plan for this run ({v['error']}); train.preflight skipped", stacklevel=2)  # fmt: skip
        return
    if v["fits"]:
        return
    fixes = v["fixes"]
    raise ValueError(
        f"the plan predicts this run does not fit: {_gib(v['peak'])} GiB of tensors + "
        f"{_gib(v['reserve'])} GiB reserve per GPU > {_gib(gib)} GiB ({', '.join(f'{k} {_gib(x)}' for k, x in v['breakdown'].items())}); "
        + (f"predicted to fit: {'; '.join(fixes)}" if fixes else "no single change of checkpointing, micro-batch, parallel.ep or LoRA fits: use more GPUs")
        + " (dropless plan --help says how it is made); set train.preflight=false to run anyway"
    )  # fmt: skip
