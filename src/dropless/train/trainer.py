"""The training loop: builds a run (model, data, optimizer, parallel layout), runs the
steps with held-out evaluation, metrics and checkpoints, and stops cleanly on SIGINT /
SIGTERM or a failed check.

    summary = train(load_config(None, ["train.steps=50"]), run_dir="runs/x")

This file is the route map of a run: `train` sets up the process (`run/`), claims the run
directory and checks what it holds under its lock (`run/rundir.py`), checks the config
(`plan/preflight.py`); `Trainer.__init__` builds the parts in order (`data/`, `model/`,
`state.py`, `checkpoint/`, `step.py`, `evaluation.py`, `report/`); `Trainer.fit` runs the
steps. docs/design.md follows it.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import time
from pathlib import Path

import torch

from .checkpoint import store as ckpt
from .checkpoint.async_save import CheckpointSaver
from .checkpoint.resume import check_run_dir, latest_run, with_nonfinite_fix
from .config.load import Config, dump_config
from .data.corpus import micro_batch_size
from .data.tokenizer import resolve_spec
from .evaluation import Evaluator
from .model.build import build_training_model
from .model.lora import ADAPTER_DIR, base_model, save_adapter
from .model.precision import Precision
from .plan.preflight import preflight
from .report.flops import FlopCounter
from .report.heartbeat import Heartbeat
from .report.run_log import RunLog
from .run.errors import Interrupted, NonFiniteError
from .run.hooks import TrainHooks
from .run.interrupts import StopRequests
from .run.lazy import hf
from .run.rundir import claim, discard_new_run, new_run_dir
from .run.setup import Env, broadcast, close_env, init_env, on_rank0, rank0_first, rank0_only
from .state import (
    TrainState,
    adamw_kernel,
    build_optimizer,
    build_scheduler,
    lr_factor,
    prepare_data,
)
from .step import StepParts, StepRunner


def model_class_name(model) -> str:
    """The model's class name; FSDP2 swaps in a subclass named FSDP<Name>, so the header
    names the class the user asked for."""
    return next(
        (c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP")),
        type(model).__name__,
    )


class Trainer:
    """One run. `Trainer(cfg, run_dir, env, hf_config, resume_from).fit()` -> summary dict."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        env: Env,
        hf_config,
        resume_from: Path | None,
        hooks: TrainHooks | None = None,
        beat: Heartbeat | None = None,
    ):
        self.cfg, self.run_dir, self.env = cfg, run_dir, env
        self.hooks = hooks or TrainHooks()
        # says what the run does when it prints nothing for a while (stdout not a terminal)
        self.beat = beat or Heartbeat(False)
        self.t_start, self.cpu_start = time.perf_counter(), time.process_time()
        tc = cfg.train
        self.config_file = run_dir / "config.toml"
        # torch's RNG is seeded where the model is built; a resume restores all three
        ckpt.seed_host_rngs(tc.seed)
        self.beat.doing("preparing the data (reading, training the tokenizer, tokenizing)")
        self.data = prepare_data(cfg, run_dir, env, lambda fn: rank0_first(fn, env))
        self.precision = Precision(cfg.precision, env.device)
        self.beat.doing(
            "building the model" + (f" from {cfg.model.path}" if cfg.model.path else "")
        )
        # several processes: FSDP2 / HSDP and, with parallel.ep > 1, expert parallelism
        self.model, self.parallel = build_training_model(
            cfg.model, hf_config, cfg.parallel, env.world, expert_bias=tc.expert_bias_rate > 0,
            seed=tc.seed, device=env.device, activation_checkpointing=tc.activation_checkpointing,
            fused_rmsnorm=tc.fused_rmsnorm, compute_dtype=self.precision.dtype, finetune=cfg.finetune,
        )  # fmt: skip
        # LoRA: base frozen, only the adapters train and are checkpointed
        self.lora = cfg.finetune.method == "lora"
        self.model_name = model_class_name(base_model(self.model))
        self.layers = hf().moe_layers(self.model)
        from ..hf.experts.router_losses import RouterLosses

        self.router = RouterLosses(self.model)
        router = self.layers[0].router
        self.top_k = int(router.top_k) if router is not None else int(hf_config.num_experts_per_tok)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, tc.steps, cfg.optim)
        self.state = TrainState(seed=tc.seed, world_size=env.world)
        self.flops = FlopCounter.from_model(self.model)
        self.flops.frozen_base = self.lora
        if resume_from is not None:
            self.beat.doing(f"loading the checkpoint {resume_from}")
            saved = ckpt.load_checkpoint(
                resume_from, self.model, self.optimizer, self.scheduler, trainable_only=self.lora
            )
            self.state = TrainState.from_dict({**saved, "world_size": env.world})
        self.start_step, self.resumed_from = self.state.step, resume_from
        self.saver = CheckpointSaver(cfg.checkpoint.async_save, cfg.parallel.timeout_s)
        if env.main:  # only now: a refused resume leaves the run's files as they were
            dump_config(cfg, self.config_file)
        self.stepper = StepRunner(cfg, env, StepParts(
            model=self.model, layers=self.layers, router=self.router, top_k=self.top_k,
            optimizer=self.optimizer, scheduler=self.scheduler, parallel=self.parallel,
            sampler=self.data.sampler, precision=self.precision, hooks=self.hooks,
        ))  # fmt: skip
        split = self.stepper.split  # parallel.cp > 1: each cp group scores its windows
        micro_batch = micro_batch_size(tc.batch_size, split.data_world, tc.grad_accum)
        self.evaluate = Evaluator(
            self.model, self.data.eval_BL1, self.data.eval_bytes, env, micro_batch,
            self.parallel is not None, self.precision, eval_targets=self.data.eval_targets,
            split=split,
        )  # fmt: skip
        self.log = RunLog(
            cfg, env, run_dir, self.precision, self.start_step if resume_from else None
        )

    def header(self) -> str:
        return self.log.header(
            self.model_name, sum(p.numel() for p in self.model.parameters()),
            sum(p.numel() for p in self.params), self.layers, self.top_k,
            self.model.config.vocab_size, self.data.tokenizer.kind, self.precision.dtype,
            self.data.train_tokens,
        )  # fmt: skip

    def save(self, wait: bool = False) -> Path:
        """A checkpoint of this step: written in the background (checkpoint.async_save), or
        complete on return when `wait` (the run's last one)."""
        req = ckpt.SaveRequest(
            run_dir=self.run_dir, step=self.state.step, model=self.model,
            optimizer=self.optimizer, scheduler=self.scheduler, trainer_state=self.state.to_dict(),
            keep=self.cfg.checkpoint.keep, config_file=self.config_file, hooks=self.hooks,
            trainable_only=self.lora,
        )  # fmt: skip
        return self.saver.save(req, wait=wait)

    def _step_flops(self, result: dict) -> float:
        tc = self.cfg.train
        c = result["counts_ME"]
        pairs = (
            int(c.sum())
            if c is not None
            else tc.batch_size * tc.seq_len * self.top_k * len(self.layers)
        )
        return self.flops.step_flops(tc.batch_size, tc.seq_len, pairs)

    def _log_step(self, result: dict) -> None:
        ev = self.evaluate()
        tc, s = self.cfg.train, self.state
        rec = self.log.record(
            s.step, result, ev, s.sample_index * tc.seq_len,
            time.perf_counter() - self.t_start, time.process_time() - self.cpu_start,
        )  # fmt: skip
        self.progress.line(self.log.line(rec))

    def _doing(self, total: int) -> str:
        """The heartbeat's line while a step runs: the step and the figures of the last ones."""
        s, done = self.state.step, self.state.step - self.start_step
        if not done:
            return f"running step {s + 1} of {total} (the first steps are the slowest)"
        per_step = self.log.train_time / done
        if self.log.window.steps:  # the training steps since the last log step
            tps, _ = self.log.window_rates()
            since = f"since the last log step (log.every={self.cfg.log.every})"
        else:  # right after a log step: the steps of this run so far
            tc = self.cfg.train
            tps = done * tc.batch_size * tc.seq_len / max(self.log.train_time, 1e-9)
            since = f"over the {done} steps of this run so far"
        return f"running step {s + 1} of {total}; {per_step:.1f} s per step, {tps:,.0f} tokens/s {since}"

    def _interrupted(self, signum: int, saved: Path) -> Interrupted:
        name = signal.Signals(signum).name
        return Interrupted(
            f"stopped by {name} after step {self.state.step}; checkpoint {saved} written. "
            f"Resume with: dropless train --run-dir {self.run_dir} --resume",
            signum,
        )

    def fit(self) -> dict:
        cfg, env, total = self.cfg, self.env, self.cfg.train.steps
        if self.state.step >= total:
            raise ValueError(
                f"the run is already at step {self.state.step} of train.steps={total}; raise train.steps to continue it (--set train.steps=N)"
            )
        ckpt.remove_partial(self.run_dir)
        self.progress = self.log.progress(total, self.state.step, on_line=self.beat.printed)
        if self.state.step == 0:
            self.beat.doing("evaluating the held-out set before step 1")
            ev = self.evaluate()
            self.state.initial_eval_loss, self.state.initial_eval_bpb = (
                ev["eval_loss"],
                ev["eval_bpb"],
            )
            self.log.write({"step": 0, **ev, "unigram_bpb": self.data.unigram_bpb})
        setup_s = time.perf_counter() - self.t_start
        self.progress.line(self.header())
        if self.resumed_from is not None:
            self.progress.line(
                f"dropless train: resumed from step {self.start_step} of {total} ({self.resumed_from})"
            )
        tc = cfg.train
        # leaving the loop, on an error too, waits for the checkpoint being written
        with StopRequests(announce=env.main) as stops, self.saver:
            while self.state.step < total:
                self.beat.doing(self._doing(total))
                t0 = time.perf_counter()
                result = self.stepper.run(self.state, stop=lambda: stops.requested)
                if env.device.type == "cuda":
                    torch.cuda.synchronize(env.device)
                dt = time.perf_counter() - t0
                self.hooks.after_step(self.state.step)
                self.saver.raise_if_failed()  # a background save's error, at once
                self.log.add_step(result, dt, self._step_flops(result), tc.batch_size * tc.seq_len)
                tps, mfu = self.log.window_rates()
                done = self.state.step - self.start_step
                eta = (total - self.state.step) * self.log.train_time / max(1, done)
                self.progress.update(self.state.step, result["loss"], tps, mfu, eta)
                last = self.state.step == total
                if self.state.step % cfg.log.every == 0 or last:
                    self.beat.doing(f"evaluating the held-out set at step {self.state.step}")
                    self._log_step(result)
                every = cfg.checkpoint.every
                if (every and self.state.step % every == 0) or last or result["stop"]:
                    self.beat.doing(f"saving the checkpoint of step {self.state.step}")
                    saved = self.save(wait=last or result["stop"])
                if result["stop"] and not last:
                    signum = stops.signum or signal.SIGTERM
                    self._finish(setup_s, signal.Signals(signum).name)
                    raise self._interrupted(signum, saved)
        if self.lora:  # the adapter in PEFT's format, for stock PEFT (every rank gathers)
            save_adapter(self.model, self.run_dir / ADAPTER_DIR)
        return self._finish(setup_s)

    def _finish(self, setup_s: float, stopped_by: str | None = None) -> dict:
        """Close the display, write plots and summary.json (marked interrupted when a
        signal stopped the run), print the table; returns the summary."""
        self.progress.close()
        try:
            return self.log.summary(
                self.state, self.start_step, self.t_start, self.cpu_start, setup_s,
                self.config_file, self.data.unigram_bpb, stopped_by,
            )  # fmt: skip
        finally:
            self.log.close()


def resolve_run_dir(run_dir: str | None, resume: bool, env: Env) -> Path:
    """The run directory: given, or (resume) the newest under runs/, or a new runs/<timestamp>."""
    if run_dir is None:
        run_dir = on_rank0(lambda: str(latest_run() if resume else new_run_dir()), env)
    return Path(run_dir)


def with_tokenizer_resolved(cfg: Config) -> Config:
    """`cfg` with data.tokenizer="auto" made concrete (see `tokenizer.resolve_spec`), so the
    run's config.toml, its resume checks and its data cache name the tokenizer it used."""
    spec = resolve_spec(cfg.data.tokenizer, cfg.model.path)
    if spec == cfg.data.tokenizer:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=spec))


def train(
    cfg: Config, run_dir: str | None = None, resume: bool = False, hooks: TrainHooks | None = None
) -> dict:
    """Run `dropless train` in this process (and its torchrun group); returns the summary.
    `hooks` (a `TrainHooks`) is called at fixed points of the run."""
    cfg = with_tokenizer_resolved(cfg)
    env = init_env(cfg.parallel.timeout_s, cfg.parallel.force_distributed)
    lock, rdir = None, None
    try:
        with Heartbeat.for_run(env.main, cfg.log.progress) as beat:
            try:
                rdir = resolve_run_dir(run_dir, resume, env)
                beat.doing("claiming the run directory and checking what it holds")
                # locked first, then checked (rank 0; every rank gets the verdict): no other
                # run changes the folder between its checks and this run
                check = functools.partial(check_run_dir, cfg, rdir, resume, env.world)
                lock = rank0_only(lambda: claim(rdir, resume, check, created=run_dir is None), env)
                resume_from = broadcast(lock.checked if env.main else None, env)
                beat.doing("checking the config and the layout")
                hf_config = preflight(cfg, env, rdir)
                trainer = Trainer(cfg, rdir, env, hf_config, resume_from, hooks, beat)
            except BaseException:
                # a run that never started leaves the folder as it was (a new one removed)
                if lock is not None:
                    lock.discard()
                elif run_dir is None and rdir is not None and env.main:
                    discard_new_run(rdir, None)  # new_run_dir made it; the claim failed
                raise
            try:
                summary = trainer.fit()
            except NonFiniteError as e:
                s = trainer.state  # the failing step is not in s.step yet
                every = s.skipped_in_a_row >= s.step - trainer.start_step + 1
                fix = with_nonfinite_fix(e, rdir, resume_from, every, cfg.train.on_nonfinite)
                raise fix from None
        return broadcast(summary, env)
    finally:
        if lock is not None:
            lock.release()
        if env.distributed:
            trainer = None  # its model and meshes hold the process groups
            close_env()


__all__ = ["Trainer", "adamw_kernel", "lr_factor", "model_class_name", "train"]
