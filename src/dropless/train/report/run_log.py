"""What a run reports: the header line, throughput windows between log steps and MFU
against a peak (a GPU's spec, or this CPU's measured rate), the metrics records (JSONL +
TensorBoard), the progress display and the end-of-run summary."""

# M MoE layers, E experts

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..checkpoint import store as ckpt
from .flops import rate
from .metrics import STARVED, MetricsWriter, balancing, load_stats, peak_memory_mib, read_metrics
from .progress import Progress

# Dense bf16 tensor-core peaks per GPU, TFLOP/s (SXM parts; fp32 runs use TF32 = half)
GPU_PEAK_BF16_TFLOPS = {"B200": 2250.0, "H200": 989.0, "H100": 989.0, "A100": 312.0}


def measure_cpu_tflops(seconds: float = 0.5, n: int = 512, warmup: float = 0.5) -> float:
    """fp32 matmul rate of this process on this CPU, TFLOP/s: the best single n^3 matmul
    over `seconds` after `warmup` seconds untimed (a fresh process runs its first second
    of matmuls several times slower), in short bursts so a busy machine's quiet moments
    still count."""
    # its own generator: the global one is the run's (dropout, stochastic rounding), saved
    # in checkpoints, and a measurement at each log step must not move it
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best / 1e12


def peak_tflops(device: torch.device, dtype: torch.dtype, user: float) -> tuple[float, str]:
    """(peak TFLOP/s of one process, where it came from) for MFU."""
    if user > 0:
        return user, "log.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, bf16 in GPU_PEAK_BF16_TFLOPS.items():
            if key in name:
                peak = bf16 if dtype == torch.bfloat16 else bf16 / 2
                return peak, f"{key} dense {'bf16' if dtype == torch.bfloat16 else 'tf32'} spec"
        return float("nan"), f"unknown GPU {name!r}: set log.peak_tflops"
    return measure_cpu_tflops(), "measured fp32 matmul on this CPU"


def processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


@dataclass
class Window:
    """Training steps since the last log record (evaluation and checkpoints excluded)."""

    time: float = 0.0
    flops: float = 0.0
    tokens: int = 0
    steps: int = 0
    loss: float = 0.0
    counts_ME: torch.Tensor | None = None
    dropped: int | None = None
    measured: bool = True  # every step of the window measured its dropped count
    skipped: int = 0
    extra: dict = field(default_factory=dict)

    def add(self, result: dict, dt: float, flops: float, tokens: int) -> None:
        self.time, self.flops, self.tokens, self.steps = (
            self.time + dt, self.flops + flops, self.tokens + tokens, self.steps + 1,
        )  # fmt: skip
        self.skipped += int(result["skipped"])
        if not result["skipped"]:
            self.loss += result["loss"]
        c = result["counts_ME"]
        if c is not None:
            self.counts_ME = c if self.counts_ME is None else self.counts_ME + c
        if result["dropped"] is None:
            self.measured = False
        else:
            self.dropped = (self.dropped or 0) + result["dropped"]


class RunLog:
    """Rank 0 writes; every rank keeps the timing totals (the summary is broadcast)."""

    def __init__(
        self, cfg, env, run_dir, precision, resume_step: int | None, beat=None, facts=None
    ):
        """`resume_step`: the step a resumed run starts from (None: a fresh run); `beat`:
        the run's `Heartbeat`, told of each line the display prints; `facts`: what the
        header line says of the run's model and data (`header`'s arguments but the dtype),
        made into `header_line` here, once the parts are built."""
        self.cfg, self.env, self.run_dir = cfg, env, run_dir
        self.peak, self.peak_source = peak_tflops(env.device, precision.dtype, cfg.log.peak_tflops)
        self.header_line = None if facts is None else self.header(dtype=precision.dtype, **facts)
        self.writer = MetricsWriter(run_dir, cfg.log.tensorboard, resume_step) if env.main else None
        #: the display: a progress bar on a terminal, else plain lines
        self.progress = Progress(
            cfg.log.progress, cfg.train.steps, resume_step or 0, env.main,
            None if beat is None else beat.printed,
        )  # fmt: skip
        self.window = Window()
        self.train_time = self.train_flops = 0.0
        # the DNA tokenizer reads one base per byte of sequence: bits per byte are per base
        self.bpb_unit = "base" if getattr(cfg.data, "tokenizer", None) == "dna" else "byte"

    def write(self, rec: dict) -> None:
        if self.writer is not None:
            self.writer.write(rec)

    def header(
        self,
        model_name: str,
        n_params: int,
        n_trainable: int,
        layers,
        top_k: int,
        vocab: int,
        tok_kind: str,
        dtype,
        train_tokens: int,
    ) -> str:
        tc = self.cfg.train
        trainable = f" ({n_trainable / 1e6:.2f}M trainable)" if n_trainable != n_params else ""
        return (
            f"dropless train: {model_name} {n_params / 1e6:.2f}M params{trainable}, {len(layers)} MoE layers x "
            f"{layers[0].num_experts} experts top-{top_k}, vocab {vocab} ({tok_kind}); {processes(self.env.world)} on "
            f"{self.env.device.type}, {str(dtype).replace('torch.', '')}; {train_tokens:,} training tokens; "
            f"global batch {tc.batch_size} x {tc.seq_len}; MFU against a peak of {rate(self.peak)} per process "
            f"({self.peak_source}{'; re-measured at each log step, the highest counts' if self.peak_source.startswith('measured') else ''}); "
            f"run dir {self.run_dir}"
        )

    def add_step(self, result: dict, dt: float, flops: float, tokens: int) -> None:
        self.window.add(result, dt, flops, tokens)
        self.train_time += dt
        self.train_flops += flops

    def window_rates(self) -> tuple[float, float]:
        """(tokens/s, MFU) of the training steps since the last log record."""
        w = self.window
        t = max(w.time, 1e-9)
        return w.tokens / t, w.flops / t / self.env.world / 1e12 / self.peak

    def record(
        self, step: int, last: dict, ev: dict, tokens_seen: int, elapsed_s: float, cpu_s: float
    ) -> dict:
        """The metrics record of a log step (resets the window)."""
        if self.peak_source.startswith("measured"):  # keep the best rate seen: a busy CPU reads low
            self.peak = max(self.peak, measure_cpu_tflops(0.1, warmup=0.05))
        w, W = self.window, self.env.world
        t = max(w.time, 1e-9)
        applied = w.steps - w.skipped
        rec = {
            "step": step, "loss": last["loss"], "loss_avg": w.loss / applied if applied else None, **ev,
            "lr": last["lr"], "grad_norm": last["grad_norm"], "lb_loss": last["lb_loss"], "z_loss": last["z_loss"],
            "tokens_per_s": w.tokens / t, "tokens_per_s_per_process": w.tokens / t / W,
            "tflops_per_process": w.flops / t / W / 1e12, "tflops_total": w.flops / t / 1e12,
            "mfu": w.flops / t / W / 1e12 / self.peak, "peak_tflops": self.peak, "peak_memory_mib": peak_memory_mib(self.env.device),
            "tokens_seen": tokens_seen, "dropped": w.dropped if w.measured else None, "skipped_steps": w.skipped,
            "elapsed_s": elapsed_s, "cpu_s": cpu_s,
        }  # fmt: skip
        rec["bpb_unit"] = self.bpb_unit
        rec.update({k: v for k, v in last.items() if k.startswith("ep_")})
        if w.counts_ME is not None:
            rec["tokens_per_expert"] = w.counts_ME.tolist()
            rec.update(load_stats(w.counts_ME))
        self.window = Window()
        self.write(rec)
        return rec

    @staticmethod
    def line(r: dict) -> str:
        load = (
            f"  max/mean load {r['max_mean_load']:.2f} (worst layer), "
            f"{r.get('starved_experts', 0)} experts < {STARVED:.0%} of mean"
            if "max_mean_load" in r
            else ""
        )
        skipped = f"  skipped {r['skipped_steps']}" if r.get("skipped_steps") else ""
        return (
            f"step {r['step']:>5}  loss {r['loss']:.4f}  held-out {r['eval_loss']:.4f} ({r['eval_bpb']:.3f} bits/{r.get('bpb_unit', 'byte')})  "
            f"lr {r['lr']:.2e}  {r['tokens_per_s']:,.0f} tok/s  {r['tflops_per_process'] * 1e3:.1f} GFLOP/s  "
            f"MFU {r['mfu']:.1%} (training steps since the last log){load}{skipped}"
        )

    def summary(
        self,
        state,
        start_step: int,
        t_start: float,
        cpu_start: float,
        setup_s: float,
        config_file,
        unigram_bpb: float,
        stopped_by: str | None = None,
    ) -> dict:
        """The end-of-run summary; rank 0 also writes plots, summary.json and the table.
        stopped_by: the signal that interrupted the run (the summary is marked interrupted)."""
        records = read_metrics(self.run_dir) if self.env.main else []
        evals = [r for r in records if "eval_bpb" in r]
        init_bpb = state.initial_eval_bpb
        if init_bpb is None:
            init_bpb = evals[0]["eval_bpb"] if evals else float("nan")
        final = evals[-1] if evals else {}
        tc, W = self.cfg.train, self.env.world
        steps_run = max(1, state.step - start_step)
        wall = time.perf_counter() - t_start
        tokens = steps_run * tc.batch_size * tc.seq_len
        train_s = max(self.train_time, 1e-9)
        measured = [r["dropped"] for r in records[1:] if "dropped" in r]
        summary = {
            "run_dir": str(self.run_dir), "steps": state.step, "interrupted": stopped_by is not None,
            "stopped_by": stopped_by, "wall_s": wall, "train_s": self.train_time,
            "cpu_s": time.process_time() - cpu_start, "setup_s": setup_s,
            "tokens_per_s": tokens / train_s, "tokens_per_s_wall": tokens / max(wall - setup_s, 1e-9),
            "tflops_per_process": self.train_flops / train_s / W / 1e12,
            "mfu": self.train_flops / train_s / W / 1e12 / self.peak, "peak_tflops": self.peak,
            "peak_source": self.peak_source, "initial_bpb": init_bpb, "final_bpb": final.get("eval_bpb"),
            "unigram_bpb": unigram_bpb, "bpb_unit": self.bpb_unit,
            "final_loss": final.get("loss"), "final_eval_loss": final.get("eval_loss"),
            "peak_memory_mib": peak_memory_mib(self.env.device), "max_mean_load": final.get("max_mean_load"),
            "starved_experts": final.get("starved_experts"), "balancing": balancing(tc),
            "dropped": sum(measured) if measured and None not in measured else None,
            "skipped_steps": state.skipped_steps,
            "checkpoint": str(ckpt.latest_checkpoint(self.run_dir)), "metrics": str(self.run_dir / "metrics.jsonl"),
            "config": str(config_file), "tensorboard": str(self.run_dir / "tensorboard") if self.cfg.log.tensorboard else None,
        }  # fmt: skip
        if self.env.main:
            from .summary import finish_report

            finish_report(self.cfg, self.run_dir, summary, records)
        return summary

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


__all__ = ["RunLog", "Window", "processes"]
