"""The training loop: data-parallel steps with gradient accumulation, router balancing,
held-out evaluation in bits per byte, metrics, checkpoints and the end-of-run summary.

    summary = train(load_config(None, ["train.steps=50"]), run_dir="runs/x")
"""

# B sequences, L sequence length, V vocabulary, T tokens, E experts, K top-k, M MoE layers

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import checkpoint as ckpt
from .config import Config, dump_config
from .data import (
    WindowSampler,
    byte_counts,
    cached_streams,
    eval_windows,
    load_corpus,
    micro_batch_indices,
    unigram_bits_per_byte,
)
from .metrics import (
    MetricsWriter,
    Progress,
    load_stats,
    measure_cpu_tflops,
    peak_memory_mib,
    peak_tflops,
    read_metrics,
)
from .model import FlopCounter, build_training_model, recipe_context
from .setup import Env, broadcast, init_env, preflight, resolve_run_dir
from .tokenizer import build_tokenizer


def lr_factor(step: int, total: int, ocfg) -> float:
    """Multiplier of optim.lr after `step` optimizer steps (warmup, then the schedule)."""
    w = ocfg.warmup_steps
    if w and step < w:
        return (step + 1) / w
    lo = ocfg.min_lr_ratio
    if ocfg.schedule == "constant":
        return 1.0
    if ocfg.schedule == "cosine":
        p = min(1.0, (step - w) / max(1, total - w))
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * p))
    start = total - int(ocfg.decay_fraction * total)  # wsd
    return (
        1.0 if step < start else 1.0 - (1 - lo) * min(1.0, (step - start) / max(1, total - start))
    )


def _hf():
    from .. import hf

    return hf


def adamw_kernel(o, par) -> dict:
    """AdamW keyword for `optim.implementation`. "auto": the fused kernel with plain
    tensors (on CPU it measured ~3.5x faster than foreach, ~4x the loop, at 87M params);
    over DTensor parameters of several meshes (FSDP x EP) torch's own default."""
    choice = o.implementation
    if choice == "auto":
        return {"fused": True} if par is None else {}
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[
        choice
    ]


class Trainer:
    """One run. `Trainer(cfg, run_dir, env, hf_config, resume_from).fit()` -> summary dict."""

    def __init__(self, cfg: Config, run_dir: Path, env: Env, hf_config, resume_from: Path | None):
        self.cfg, self.run_dir, self.env = cfg, run_dir, env
        self.t_start, self.cpu_start = time.perf_counter(), time.process_time()
        tc = cfg.train
        self.A, self.W, self.B, self.L = tc.grad_accum, env.world, tc.batch_size, tc.seq_len
        self.b = self.B // (self.W * self.A)
        self.config_file = run_dir / "config.toml"
        if env.main:
            dump_config(cfg, self.config_file)
        self._data()
        # several processes: FSDP2 / HSDP and, with parallel.ep > 1, expert parallelism
        self.model, self.par = build_training_model(
            cfg.model,
            hf_config,
            cfg.parallel,
            env.world,
            expert_bias=tc.expert_bias_rate > 0,
            seed=tc.seed,
            device=env.device,
            activation_checkpointing=tc.activation_checkpointing,
            fused_rmsnorm=tc.fused_rmsnorm,
        )
        self.layers = _hf().moe_layers(self.model)
        self.router = _hf().RouterLosses(self.model)
        self.K = (
            int(self.layers[0].router.top_k)
            if self.layers[0].router is not None
            else int(hf_config.num_experts_per_tok)
        )
        self.V = self.model.config.vocab_size
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._ce_seen: list[torch.Tensor] = []
        if tc.fused_cross_entropy:
            self._fuse_cross_entropy()
        self.optimizer = self._optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, tc.steps, cfg.optim)
        )
        self.dtype = (
            torch.bfloat16
            if cfg.precision.dtype == "bf16"
            or (cfg.precision.dtype == "auto" and env.device.type == "cuda")
            else torch.float32
        )
        self.recipe = recipe_context(cfg.precision)
        self.need_router = tc.aux_loss_coef > 0 or tc.z_loss_coef > 0
        self.flops = FlopCounter.from_model(self.model)
        self.peak, self.peak_source = peak_tflops(env.device, self.dtype, cfg.log.peak_tflops)
        self.step, self.sample_index, self.state = 0, 0, {}
        if resume_from is not None:
            self.state = ckpt.load_checkpoint(
                resume_from, self.model, self.optimizer, self.scheduler
            )
            self.step, self.sample_index = (
                int(self.scheduler.last_epoch),
                int(self.state["sample_index"]),
            )
        self.writer = (
            MetricsWriter(run_dir, cfg.log.tensorboard, self.step if resume_from else None)
            if env.main
            else None
        )

    # ---- setup ---------------------------------------------------------------------
    def _data(self) -> None:
        cfg, env = self.cfg, self.env
        corpus = []

        def docs():
            if not corpus:
                corpus.append(load_corpus(cfg.data))
            return corpus[0]

        if env.main:  # rank 0 trains the tokenizer and tokenizes; the others read the cache
            self.tok = build_tokenizer(
                cfg.data.tokenizer,
                self.run_dir / "tokenizer",
                lambda: docs()[0],
                cfg.data.bpe_vocab_size,
            )
            train, held = cached_streams(cfg.data, self.tok, self.run_dir / "data", docs)
        if env.world > 1:
            dist.barrier()
        if not env.main:
            self.tok = build_tokenizer(
                cfg.data.tokenizer,
                self.run_dir / "tokenizer",
                lambda: docs()[0],
                cfg.data.bpe_vocab_size,
            )
            train, held = cached_streams(cfg.data, self.tok, self.run_dir / "data", docs)
        self.sampler = WindowSampler(train, self.L, cfg.train.seed)
        self.eval_BL1 = eval_windows(held, self.L, cfg.data.eval_tokens)
        targets = self.eval_BL1[:, 1:].reshape(-1)
        self.eval_bytes = int(self.tok.nbytes_V[targets].sum())
        self.unigram_bpb = unigram_bits_per_byte(
            byte_counts(self.tok, train), self.tok.token_bytes(targets)
        )
        self.train_tokens = len(train)

    def _fuse_cross_entropy(self) -> None:
        """The model computes the loss from its hidden states given labels (no [T, V]
        logits, `dropless.hf.fused_loss`); the cross-entropy alone (without the aux loss a
        family adds to `out.loss`) is read where the model's loss function returns it."""
        from ..hf.fused_loss import enable_fused_cross_entropy

        try:
            enable_fused_cross_entropy(self.model)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"train.fused_cross_entropy=true: {e}; set train.fused_cross_entropy=false"
            ) from None
        fused_loss = self.model.loss_function

        def loss_function(*args, **kwargs):
            loss = fused_loss(*args, **kwargs)
            self._ce_seen.append(loss)
            return loss

        self.model.loss_function = loss_function

    def _optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(
            groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **adamw_kernel(o, self.par)
        )

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.env.device.type, dtype=self.dtype)

    # ---- one step --------------------------------------------------------------------
    def _micro_step(
        self, xy_BL1: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        tc = self.cfg.train
        x, y = xy_BL1[:, :-1], xy_BL1[:, 1:]
        kw = dict(output_router_logits=self.need_router, use_cache=False)
        if self.cfg.train.fused_cross_entropy:  # y as the already shifted labels
            kw.update(labels=y, shift_labels=y)
        self._ce_seen.clear()
        with self._autocast(), self.recipe(), self.router.capture():
            out = self.model(input_ids=x, **kw)
        if self.cfg.train.fused_cross_entropy:
            assert len(self._ce_seen) == 1, "the fused loss ran once per forward"
            ce = self._ce_seen.pop()
        else:
            logits = out.logits.float()
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        # the model's own router outputs and selected experts (dropless.hf.router_losses)
        rs = self.router.stats(out, x.shape, self.need_router)
        loss = ce + tc.aux_loss_coef * rs.aux + tc.z_loss_coef * rs.z
        with self.recipe():  # activation checkpointing recomputes forwards in backward
            (loss / self.A).backward()
        return ce.detach(), rs.aux.detach(), rs.z.detach(), rs.counts_ME

    def _all_reduce_grads(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(self.W)
        for p, g, f in zip(self.params, grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(f)
            p.grad = g

    def train_step(self) -> dict:
        self.model.train()
        M, E = len(self.layers), self.layers[0].num_experts
        dev = self.env.device
        # device accumulators: no host read until the step's one reduction below
        sums = torch.zeros(3, dtype=torch.float64, device=dev)
        counts_ME = torch.zeros(M, E, dtype=torch.int64, device=dev)
        _hf().tokens_per_expert(self.model, reset=True)  # drop counts of earlier forwards
        for a in range(self.A):
            idx = micro_batch_indices(self.sample_index, a, self.env.rank, self.W, self.B, self.A)
            xy = torch.from_numpy(self.sampler.batch(idx)).to(dev)
            ce, lb, zl, c = self._micro_step(xy)
            sums += torch.stack([ce, lb, zl]).double() / self.A
            counts_ME += c.to(dev)
        # pairs the dropless experts path computed (None on the stock path)
        path_ME = _hf().tokens_per_expert(self.model, reset=True)
        path_pairs = torch.tensor([-1.0 if path_ME is None else float(path_ME.sum())])
        sums, counts_ME = sums.cpu(), counts_ME.cpu()
        stats = torch.cat([sums, counts_ME.double().reshape(-1), path_pairs.double()])
        if self.W > 1:
            if self.par is None:  # FSDP already reduced them
                self._all_reduce_grads()
            dist.all_reduce(stats)
            stats[:3] /= self.W
        clip = self.cfg.optim.grad_clip or float("inf")
        if self.par is not None:  # parameters on several DTensor meshes
            grad_norm = self.par.clip_grad_norm_(self.params, clip)
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        counts_ME = stats[3:-1].reshape(M, E).round().long()
        if path_ME is not None:
            expected = self.B * self.L * self.K
            dropped = int(expected * M - stats[-1].round())
            assert dropped == 0, (
                f"{dropped} (token, expert) pairs were dropped; the dropless path must compute all"
            )
        if self.cfg.train.expert_bias_rate > 0:
            from ..ops import update_expert_bias

            for layer, c in zip(self.layers, counts_ME):
                update_expert_bias(
                    layer.expert_bias,
                    c.to(layer.expert_bias.device),
                    self.cfg.train.expert_bias_rate,
                )
        self.step += 1
        self.sample_index += self.B
        ep_stats = self.par.pop_stats() if self.par is not None else {}  # EP time split, bytes
        if self.par is not None:
            self.par.after_step(self.step)
        return {
            "loss": float(stats[0]),
            "lb_loss": float(stats[1]),
            "z_loss": float(stats[2]),
            "lr": lr,
            "grad_norm": grad_norm,
            "counts_ME": counts_ME,
            **ep_stats,
        }

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss (nats/token) and bits per byte, windows split over processes."""
        self.model.eval()
        acc = torch.zeros(2, dtype=torch.float64)  # nll sum, targets
        mine, b = self.eval_BL1[self.env.rank :: self.W], max(self.b, 1)
        n = -(-len(mine) // b)
        if self.par is not None:  # forwards are collective (FSDP, EP): as many on every rank
            n_t = torch.tensor([n])
            dist.all_reduce(n_t, op=dist.ReduceOp.MAX)
            n = int(n_t)
        for j in range(n):
            part = mine[j * b : (j + 1) * b]
            xy = torch.from_numpy(part if len(part) else self.eval_BL1[:1]).to(self.env.device)
            with self._autocast(), self.recipe():
                logits = self.model(input_ids=xy[:, :-1], use_cache=False).logits
            if not len(part):  # a filler forward on a rank with no windows left
                continue
            nll = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1), reduction="sum"
            )
            acc += torch.stack(
                [nll.double().cpu(), torch.tensor(float(xy[:, 1:].numel()), dtype=torch.float64)]
            )
        if self.W > 1:
            dist.all_reduce(acc)
        _hf().tokens_per_expert(self.model, reset=True)
        return {
            "eval_loss": float(acc[0] / acc[1]),
            "eval_bpb": float(acc[0] / math.log(2) / self.eval_bytes),
        }

    # ---- the run -----------------------------------------------------------------------
    def _save(self) -> Path:
        st = {
            "sample_index": self.sample_index,
            "seed": self.cfg.train.seed,
            "world_size": self.W,
            **{k: v for k, v in self.state.items() if k.startswith("initial_")},
        }
        return ckpt.save_checkpoint(
            self.run_dir,
            self.step,
            self.model,
            self.optimizer,
            self.scheduler,
            st,
            keep=self.cfg.checkpoint.keep,
            config_file=self.config_file,
        )

    def fit(self) -> dict:
        cfg, env, total = self.cfg, self.env, self.cfg.train.steps
        if self.step >= total:
            raise ValueError(
                f"the run is already at step {self.step} of train.steps={total}; raise train.steps to continue it (--set train.steps=N)"
            )
        ckpt.remove_partial(self.run_dir)
        progress = Progress(cfg.log.progress, total, self.step, env.main)
        if self.step == 0:
            ev = self.evaluate()
            self.state.update(initial_eval_loss=ev["eval_loss"], initial_eval_bpb=ev["eval_bpb"])
            self._write({"step": 0, **ev, "unigram_bpb": self.unigram_bpb})
        self.setup_s = time.perf_counter() - self.t_start
        progress.line(self._header())
        window = {"time": 0.0, "flops": 0.0, "tokens": 0, "steps": 0, "loss": 0.0, "counts": None}
        train_time = train_flops = 0.0
        last = {}
        while self.step < total:
            t0 = time.perf_counter()
            last = self.train_step()
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            dt = time.perf_counter() - t0
            pairs = (
                int(last["counts_ME"].sum())
                if last["counts_ME"] is not None
                else self.B * self.L * self.K * len(self.layers)
            )
            fl = self.flops.step_flops(self.B, self.L, pairs)
            window["time"] += dt
            window["flops"] += fl
            window["tokens"] += self.B * self.L
            window["steps"] += 1
            window["loss"] += last["loss"]
            if last["counts_ME"] is not None:
                window["counts"] = (
                    last["counts_ME"]
                    if window["counts"] is None
                    else window["counts"] + last["counts_ME"]
                )
            train_time += dt
            train_flops += fl
            tps = window["tokens"] / window["time"]
            mfu = window["flops"] / window["time"] / self.W / 1e12 / self.peak
            progress.update(
                self.step,
                last["loss"],
                tps,
                mfu,
                (total - self.step) * train_time / max(1, self.step - self._start_step),
            )
            if self.step % cfg.log.every == 0 or self.step == total:
                rec = self._record(last, window)
                self._write(rec)
                progress.line(self._line(rec))
                window = {
                    "time": 0.0,
                    "flops": 0.0,
                    "tokens": 0,
                    "steps": 0,
                    "loss": 0.0,
                    "counts": None,
                }
            if (
                cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0
            ) or self.step == total:
                self._save()
        progress.close()
        return self._finish(train_time, train_flops)

    _start_step = 0

    def _record(self, last: dict, window: dict) -> dict:
        ev = self.evaluate()
        if self.peak_source.startswith("measured"):  # keep the best rate seen: a busy CPU reads low
            self.peak = max(self.peak, measure_cpu_tflops(0.1, warmup=0.05))
        t = window["time"]
        rec = {
            "step": self.step, "loss": last["loss"], "loss_avg": window["loss"] / window["steps"], **ev,
            "lr": last["lr"], "grad_norm": last["grad_norm"], "lb_loss": last["lb_loss"], "z_loss": last["z_loss"],
            "tokens_per_s": window["tokens"] / t, "tokens_per_s_per_process": window["tokens"] / t / self.W,
            "tflops_per_process": window["flops"] / t / self.W / 1e12, "tflops_total": window["flops"] / t / 1e12,
            "mfu": window["flops"] / t / self.W / 1e12 / self.peak, "peak_tflops": self.peak, "peak_memory_mib": peak_memory_mib(self.env.device),
            "tokens_seen": self.sample_index * self.L, "dropped": 0, "elapsed_s": time.perf_counter() - self.t_start,
            "cpu_s": time.process_time() - self.cpu_start,
        }  # fmt: skip
        rec.update({k: v for k, v in last.items() if k.startswith("ep_")})
        if window["counts"] is not None:
            rec["tokens_per_expert"] = window["counts"].tolist()
            rec.update(load_stats(window["counts"]))
        return rec

    def _write(self, rec: dict) -> None:
        if self.writer is not None:
            self.writer.write(rec)

    def _header(self) -> str:
        n = sum(p.numel() for p in self.params)
        return (
            f"dropless train: {type(self.model).__name__} {n / 1e6:.2f}M params, {len(self.layers)} MoE layers x "
            f"{self.layers[0].num_experts} experts top-{self.K}, vocab {self.V} ({self.tok.kind}); {self.W} process(es) on "
            f"{self.env.device.type}, {str(self.dtype).replace('torch.', '')}; {self.train_tokens:,} training tokens; "
            f"global batch {self.B} x {self.L}; MFU peak {self.peak:.3g} TFLOP/s/process ({self.peak_source}); run dir {self.run_dir}"
        )

    def _line(self, r: dict) -> str:
        load = f"  max/mean load {r['max_mean_load']:.2f}" if "max_mean_load" in r else ""
        return (
            f"step {r['step']:>5}  loss {r['loss']:.4f}  held-out {r['eval_loss']:.4f} ({r['eval_bpb']:.3f} bits/byte)  "
            f"lr {r['lr']:.2e}  {r['tokens_per_s']:,.0f} tok/s  {r['tflops_per_process'] * 1e3:.1f} GFLOP/s  MFU {r['mfu']:.1%}{load}"
        )

    def _finish(self, train_time: float, train_flops: float) -> dict:
        records = read_metrics(self.run_dir) if self.env.main else []
        evals = [r for r in records if "eval_bpb" in r]
        init_bpb = self.state.get(
            "initial_eval_bpb", evals[0]["eval_bpb"] if evals else float("nan")
        )
        final = evals[-1] if evals else {}
        steps_run = max(1, self.step - self._start_step)
        summary = {
            "run_dir": str(self.run_dir), "steps": self.step, "wall_s": time.perf_counter() - self.t_start, "train_s": train_time,
            "cpu_s": time.process_time() - self.cpu_start, "setup_s": self.setup_s,
            "tokens_per_s": steps_run * self.B * self.L / max(train_time, 1e-9),
            "tflops_per_process": train_flops / max(train_time, 1e-9) / self.W / 1e12,
            "mfu": train_flops / max(train_time, 1e-9) / self.W / 1e12 / self.peak, "peak_tflops": self.peak,
            "peak_source": self.peak_source, "initial_bpb": init_bpb, "final_bpb": final.get("eval_bpb"),
            "unigram_bpb": self.unigram_bpb, "final_loss": final.get("loss"), "final_eval_loss": final.get("eval_loss"),
            "peak_memory_mib": peak_memory_mib(self.env.device), "max_mean_load": final.get("max_mean_load"),
            "checkpoint": str(ckpt.latest_checkpoint(self.run_dir)), "metrics": str(self.run_dir / "metrics.jsonl"),
            "config": str(self.config_file), "tensorboard": str(self.run_dir / "tensorboard") if self.cfg.log.tensorboard else None,
        }  # fmt: skip
        if self.env.main:
            from .report import finish_report

            finish_report(self, summary, records)
        if self.writer is not None:
            self.writer.close()
        return summary


def train(cfg: Config, run_dir: str | None = None, resume: bool = False) -> dict:
    """Run `dropless train` in this process (and its torchrun group); returns the summary."""
    env = init_env()
    try:
        rdir = resolve_run_dir(run_dir, resume, env)
        hf_config, resume_from = preflight(cfg, env, rdir, resume)
        trainer = Trainer(cfg, rdir, env, hf_config, resume_from)
        trainer._start_step = trainer.step
        summary = trainer.fit()
        return broadcast(summary, env)
    finally:
        if env.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["Trainer", "lr_factor", "train"]
