"""A run's parts, built once, in order, each from the previous one: the run directory
(claimed, then checked under its lock), the preflight checks, the data (tokenizer, token
streams, sampler, held-out windows), the model (built, patched, LoRA) laid out over the
processes (`model/build.py`, `model/parallelize.py`), the optimizer and its schedule, the
state (fresh or resumed), the step, the evaluation and the log.

    parts, claim = open_run(cfg, run_dir, resume, env, hooks, beat)

`trainer.py` runs the loop over these parts; docs/design.md's route follows this order.
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import store as ckpt
from .checkpoint.async_save import CheckpointSaver
from .checkpoint.resume import check_run_dir, latest_run
from .config.load import Config, dump_config
from .data.corpus import RunData, micro_batch_size, text_data
from .data.tokenizer import build_tokenizer
from .data.tokenizer import resolve as resolve_tokenizer
from .evaluation import Evaluator
from .model.build import build_training_model
from .model.lora import base_model
from .model.precision import Precision
from .plan.preflight import preflight
from .report.flops import FlopCounter
from .report.heartbeat import Heartbeat
from .report.run_log import RunLog
from .run.hooks import TrainHooks
from .run.lazy import hf
from .run.rundir import claim, new_run_dir, remove_if_empty
from .run.setup import Env, broadcast, on_rank0, rank0_only
from .state import TrainState, optimizer_and_schedule
from .step import StepParts, StepRunner


@dataclass
class RunParts:
    """Everything a run's loop uses, each part made once by `build_run`."""

    cfg: Config
    env: Env
    run_dir: Path
    hooks: TrainHooks
    beat: Heartbeat
    t_start: float  # when the build began (perf_counter), for the setup time and rates
    cpu_start: float
    config_file: Path
    data: Any  # corpus.RunData: tokenizer, sampler, held-out windows, unigram figure
    precision: Precision
    model: Any
    lora: bool
    layers: list
    top_k: int
    optimizer: Any
    scheduler: Any
    state: TrainState
    flops: FlopCounter
    start_step: int
    resumed_from: Path | None
    saver: CheckpointSaver
    stepper: StepRunner
    evaluate: Evaluator
    log: RunLog


def model_class_name(model) -> str:
    """The model's class name; FSDP2 swaps in a subclass named FSDP<Name>, so the header
    names the class the user asked for."""
    return next(
        (c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP")),
        type(model).__name__,
    )


def resolve_run_dir(run_dir: str | None, resume: bool, env: Env) -> Path:
    """The run directory: given, or (resume) the newest under runs/, or a new runs/<timestamp>."""
    if run_dir is None:
        run_dir = on_rank0(lambda: str(latest_run() if resume else new_run_dir()), env)
    return Path(run_dir)


def seed_host_rngs(seed: int) -> None:
    """Seed Python's `random` and NumPy's global RNG from `seed` (any int in [0, 2**63)),
    as torch's is seeded: with the states a checkpoint saves and restores, a resumed run's
    equal an uninterrupted one's."""
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])


def rank0_first(fn, env: Env):
    """`fn()` on rank 0, then (once it succeeded) on the other ranks, which read the cache
    it filled. The wait is a collective bounded by parallel.timeout_s."""
    result = rank0_only(fn, env)
    return result if env.main else fn()


def prepare_data(cfg, run_dir: Path, env) -> RunData:
    """The run's data, prepared on rank 0 first, then on the other ranks (which read the
    tokenizer and token streams rank 0 cached in the run directory): text through
    `corpus.text_data`, supervised records (messages, prompt/completion) as padded rows
    (`data/sft.py`)."""
    from .data.sft import prepare_sft, sft_kind

    kind = sft_kind(cfg.data.path) if cfg.data.path else None
    if kind is None:
        return rank0_first(functools.partial(text_data, cfg, run_dir, env.main), env)

    def make_tokenizer(texts):
        return rank0_first(
            lambda: build_tokenizer(
                cfg.data.tokenizer, run_dir / "tokenizer", lambda: texts, cfg.data.bpe_vocab_size
            ),
            env,
        )

    return prepare_sft(cfg, kind, make_tokenizer, cfg.train.seq_len, verbose=env.main)


def open_run(cfg: Config, run_dir: str | None, resume: bool, env: Env, hooks, beat):
    """-> (RunParts, the run directory's claim, to release when the run ends). The folder
    is locked first, then checked (rank 0; every rank gets the verdict): no other run changes
    it between its checks and this run. A run that fails before training leaves the folder
    as it was (one this process made is removed)."""
    claimed, rdir = None, None
    try:
        rdir = resolve_run_dir(run_dir, resume, env)
        beat.doing = "claiming the run directory and checking what it holds"
        check = functools.partial(check_run_dir, cfg, rdir, resume, env.world)
        claimed = rank0_only(
            functools.partial(claim, rdir, resume, check, created=run_dir is None), env
        )
        resume_from = broadcast(claimed.checked if env.main else None, env)
        return build_run(cfg, env, rdir, resume_from, hooks, beat), claimed
    except BaseException:
        if claimed is not None:
            claimed.discard()
        elif run_dir is None and rdir is not None and env.main:
            remove_if_empty(rdir)  # new_run_dir made it; the claim failed
        raise


def build_run(cfg, env, run_dir: Path, resume_from, hooks, beat) -> RunParts:
    """The parts of a run in a claimed `run_dir`, in order (see the module's docstring)."""
    hooks = hooks or TrainHooks()
    beat.doing = "checking the config and the layout"
    cfg, vocab = resolve_tokenizer(cfg, run_dir)  # data.tokenizer="auto" made concrete
    precision = Precision(cfg.precision, env.device)  # a bad recipe option is reported here
    hf_config = preflight(cfg, env, run_dir, vocab)
    t_start, cpu_start, tc = time.perf_counter(), time.process_time(), cfg.train
    # torch's RNG is seeded where the model is built; a resume restores all three
    seed_host_rngs(tc.seed)
    ckpt.remove_partial(run_dir)  # leftovers of interrupted checkpoint writes (rank 0)
    beat.doing = "preparing the data (reading, training the tokenizer, tokenizing)"
    data = prepare_data(cfg, run_dir, env)
    beat.doing = "building the model" + (f" from {cfg.model.path}" if cfg.model.path else "")
    # several processes: FSDP2 / HSDP and, with parallel.ep > 1, expert parallelism
    model, parallel = build_training_model(
        cfg.model, hf_config, cfg.parallel, env.world, expert_bias=tc.expert_bias_rate > 0,
        seed=tc.seed, device=env.device, activation_checkpointing=tc.activation_checkpointing,
        fused_rmsnorm=tc.fused_rmsnorm, compute_dtype=precision.dtype, finetune=cfg.finetune,
    )  # fmt: skip
    layers = hf().moe_layers(model)
    from ..hf.experts.router_losses import RouterLosses

    router = RouterLosses(model)
    gate = layers[0].router
    top_k = int(gate.top_k) if gate is not None else int(hf_config.num_experts_per_tok)
    lora = cfg.finetune.method == "lora"  # base frozen, only the adapters train and are saved
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optimizer_and_schedule(params, cfg.optim, tc.steps)
    state = TrainState(seed=tc.seed, world_size=env.world)
    flops = FlopCounter.from_model(model)
    flops.frozen_base = lora
    if resume_from is not None:
        beat.doing = f"loading the checkpoint {resume_from}"
        saved = ckpt.load_checkpoint(resume_from, model, optimizer, scheduler, trainable_only=lora)
        state = TrainState.from_dict({**saved, "world_size": env.world})
        if state.step >= tc.steps:
            raise ValueError(
                f"the run is already at step {state.step} of train.steps={tc.steps}; raise train.steps to continue it (--set train.steps=N)"
            )
    saver = CheckpointSaver(cfg.checkpoint.async_save, cfg.parallel.timeout_s)
    config_file = run_dir / "config.toml"
    if env.main:  # only now: a refused resume leaves the run's files as they were
        dump_config(cfg, config_file)
    stepper = StepRunner(cfg, env, StepParts(
        model=model, layers=layers, router=router, top_k=top_k, optimizer=optimizer,
        scheduler=scheduler, parallel=parallel, sampler=data.sampler, precision=precision,
        hooks=hooks,
    ))  # fmt: skip
    split = stepper.split  # parallel.cp > 1: each cp group scores its windows
    micro_batch = micro_batch_size(tc.batch_size, split.data_world, tc.grad_accum)
    evaluate = Evaluator(
        model, data.eval_BL1, data.eval_bytes, env, micro_batch, parallel is not None,
        precision, eval_targets=data.eval_targets, split=split,
    )  # fmt: skip
    model_name = model_class_name(base_model(model))
    facts = dict(
        model_name=model_name, n_params=sum(p.numel() for p in model.parameters()),
        n_trainable=sum(p.numel() for p in params), layers=layers, top_k=top_k,
        vocab=model.config.vocab_size, tok_kind=data.tokenizer.kind, train_tokens=data.train_tokens,
    )  # fmt: skip
    log = RunLog(cfg, env, run_dir, precision, state.step if resume_from else None, beat, facts)
    return RunParts(
        cfg=cfg, env=env, run_dir=run_dir, hooks=hooks, beat=beat, t_start=t_start,
        cpu_start=cpu_start, config_file=config_file, data=data, precision=precision,
        model=model, lora=lora, layers=layers, top_k=top_k, optimizer=optimizer, scheduler=scheduler, state=state, flops=flops, start_step=state.step,
        resumed_from=resume_from, saver=saver, stepper=stepper, evaluate=evaluate, log=log,
    )  # fmt: skip
