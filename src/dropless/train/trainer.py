"""The training loop: runs a run's steps with held-out evaluation, metrics and
checkpoints, and stops cleanly on SIGINT / SIGTERM or a failed check.

    summary = train(load_config(None, ["train.steps=50"]), run_dir="runs/x")

`train` sets up the process (`run/setup.py`) and has `build.py` claim the run directory and
build the run's parts once, in order; `Trainer.fit` runs the steps over them.
docs/design.md's route follows it.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import torch

from .build import RunParts, open_run
from .checkpoint import store as ckpt
from .checkpoint.resume import with_nonfinite_fix
from .config.load import Config
from .model.lora import ADAPTER_DIR, save_adapter
from .report.heartbeat import Heartbeat
from .run.errors import Interrupted, NonFiniteError
from .run.hooks import TrainHooks
from .run.interrupts import StopRequests
from .run.setup import broadcast, close_env, init_env


class Trainer:
    """One run's loop: `Trainer(build_run(...)).fit()` -> summary dict."""

    def __init__(self, parts: RunParts):
        self.__dict__.update(vars(parts))  # the parts by name: self.model, self.state, ...

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
        self.progress = self.log.progress
        if self.state.step == 0:
            self.beat.doing = "evaluating the held-out set before step 1"
            ev = self.evaluate()
            self.state.initial_eval_loss, self.state.initial_eval_bpb = (
                ev["eval_loss"],
                ev["eval_bpb"],
            )
            self.log.write({"step": 0, **ev, "unigram_bpb": self.data.unigram_bpb})
        setup_s = time.perf_counter() - self.t_start
        self.progress.line(self.log.header_line)
        if self.resumed_from is not None:
            self.progress.line(
                f"dropless train: resumed from step {self.start_step} of {total} ({self.resumed_from})"
            )
        tc = cfg.train
        # leaving the loop, on an error too, waits for the checkpoint being written
        with StopRequests(announce=env.main) as stops, self.saver:
            while self.state.step < total:
                self.beat.doing = self._doing(total)
                t0 = time.perf_counter()
                result = self.stepper.run(self.state, stops)
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
                    self.beat.doing = f"evaluating the held-out set at step {self.state.step}"
                    self._log_step(result)
                every = cfg.checkpoint.every
                if (every and self.state.step % every == 0) or last or result["stop"]:
                    self.beat.doing = f"saving the checkpoint of step {self.state.step}"
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


def train(
    cfg: Config, run_dir: str | None = None, resume: bool = False, hooks: TrainHooks | None = None
) -> dict:
    """Run `dropless train` in this process (and its torchrun group); returns the summary.
    `hooks` (a `TrainHooks`) is called at fixed points of the run."""
    env = init_env(cfg.parallel.timeout_s, cfg.parallel.force_distributed)
    beat = Heartbeat.for_run(env.main, cfg.log.progress)
    claimed = trainer = parts = None
    try:
        try:
            parts, claimed = open_run(cfg, run_dir, resume, env, hooks, beat)
            trainer = Trainer(parts)
            try:
                summary = trainer.fit()
            except NonFiniteError as e:
                s = trainer.state  # the failing step is not in s.step yet
                every = s.skipped_in_a_row >= s.step - trainer.start_step + 1
                raise with_nonfinite_fix(
                    e, parts.run_dir, parts.resumed_from, every, cfg.train.on_nonfinite
                ) from None
        finally:
            beat.close()
        return broadcast(summary, env)
    finally:
        if claimed is not None:
            claimed.release()
        if env.distributed:
            trainer = parts = None  # its model and meshes hold the process groups
            close_env()
