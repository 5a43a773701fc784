#!/usr/bin/env python
"""Per-rank peak memory of a training step with context parallelism, on gloo (CPU), and
the plan of the same step.

    python scripts/cp_memory.py 65536 1,2,4     # sequence length, then the cp sizes
    python scripts/cp_memory.py 65536 1,2,4 --rounds 3 --section benchmarks/sections/cp.md

For each cp size, cp gloo processes (cp = world) train a tiny Qwen3-MoE (hidden 32, 2
layers, 4 experts, fp32, activation checkpointing, batch 1) on one sequence of that
length through the trainer's own micro-batch (`train.step.MicroStep` with the
`ContextSplit`) and optimizer step; the second step is measured with the tracker of the
plan calibration (tests/train/program_memory.py: FSDP2's tracker, the peak of live tensor
bytes). Prints each rank's peak (MiB) and its step time (s). Rounds run the cp sizes in
turn (interleaved). `dropless plan`'s traced peak of the same configuration at
gpus = cp is printed beside it (the planner's own figure, before its reserve); with
`--section` the markdown table (busiest rank, median over rounds and spread) is written.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SETS = [
    "data.tokenizer=bytes", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
    "model.num_kv_heads=1", "model.head_dim=16", "model.num_experts=4",
    "model.moe_intermediate_size=32", "train.activation_checkpointing=true", "train.batch_size=1",
    "precision.dtype=fp32", "train.aux_loss_coef=0", "parallel.force_distributed=true",
]  # fmt: skip


def _rank(rank: int, world: int, seq_len: int, store: str, q) -> None:
    """One gloo rank: two training steps, the second under the tracker."""
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tests" / "train"))
    from program_memory import ProgramMemTracker

    from dropless.hf.experts.router_losses import RouterLosses
    from dropless.train.config.load import load_config
    from dropless.train.data.context_split import ContextSplit
    from dropless.train.model.build import build_training_model
    from dropless.train.model.precision import Precision
    from dropless.train.plan.trace import resolve_hf_config
    from dropless.train.state import build_optimizer
    from dropless.train.step import MicroStep, fuse_cross_entropy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    sets = [
        f"train.seq_len={seq_len}",
        f"model.max_position_embeddings={seq_len}",
        f"parallel.cp={world}",
    ]
    cfg = load_config(None, [*SETS, *sets])
    model, par = build_training_model(
        cfg.model, resolve_hf_config(cfg), cfg.parallel, world, expert_bias=False, seed=0,
        device=torch.device("cpu"), activation_checkpointing=True, fused_rmsnorm=cfg.train.fused_rmsnorm,
    )  # fmt: skip
    seen = fuse_cross_entropy(model) if cfg.train.fused_cross_entropy else None
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optim)
    split, group = None, None
    if world > 1:
        split, group = ContextSplit(0, 1, par.cp_rank, world), par.pmesh.cp_group
    precision = Precision(cfg.precision, torch.device("cpu"))
    micro = MicroStep.for_run(cfg, model, precision, RouterLosses(model), seen, split, group)
    g = torch.Generator().manual_seed(0)  # every rank draws the same sequence

    def step():
        micro(torch.randint(0, model.config.vocab_size, (1, seq_len + 1), generator=g))
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on, as in every later step
    tracker = ProgramMemTracker(model, opt)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
        with tracker:
            step()
    peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    q.put((rank, peak, time.perf_counter() - t0))
    dist.destroy_process_group()


def _measure(seq_len: int, cp: int) -> list[tuple[int, int, float]]:
    """(rank, peak bytes, step seconds) of each of cp spawned gloo ranks."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(target=_rank, args=(r, cp, seq_len, f"{d}/store", q)) for r in range(cp)
        ]
        for p in procs:
            p.start()
        res = sorted(q.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
    return res


def _planned(seq_len: int, cp: int) -> int:
    """`dropless plan`'s traced peak (bytes, before its reserve) of this step at gpus = cp."""
    from dropless.train.config.load import load_config
    from dropless.train.plan.trace import make_plan

    sets = [
        f"train.seq_len={seq_len}",
        f"model.max_position_embeddings={seq_len}",
        f"parallel.cp={cp}",
    ]
    plan = make_plan(
        load_config(None, [*SETS, *sets]), gpus=cp, gpu_memory_gib=80, compare_checkpointing=False
    )
    return int(plan.peak_gib_per_gpu * 2**30)


def _section(record: dict, seq_len: int, sizes: list[int]) -> str:
    from tools.bench_sections import provenance

    fig = record["figures"]
    base = statistics.median(fig["peak_mib"]["1"]) if "1" in fig["peak_mib"] else None
    rows = []
    for cp in sizes:
        peaks, times = fig["peak_mib"][str(cp)], fig["step_s"][str(cp)]
        peak, plan = statistics.median(peaks), fig["plan_mib"][str(cp)]
        ratio = f"{peak / base:.3f}x" if base else "-"
        rows.append(
            f"| {cp} | {seq_len // cp:,} | {peak:.1f} ({min(peaks):.1f}-{max(peaks):.1f}) | {ratio} "
            f"| {plan:.1f} | {plan / peak:.3f} | {statistics.median(times):.1f} "
            f"({min(times):.1f}-{max(times):.1f}) |"
        )
    return "\n".join(
        ["## Context parallelism: per-rank memory of one long sequence (`scripts/cp_memory.py`)", "",
         provenance(record), "",
         f"One training step of a tiny Qwen3-MoE (hidden 32, 2 layers, 4 experts, fp32, activation "
         f"checkpointing) on one {seq_len:,}-token sequence split over cp gloo processes (one "
         f"thread each, on this machine's cores). Peak: the busiest rank's peak of live tensor "
         f"bytes in the second step (the plan calibration's tracker), median over "
         f"{fig['rounds']} interleaved rounds (min-max). Plan: `dropless plan`'s traced peak of "
         f"the same step at gpus = cp (before its reserve). Step time: the slowest rank's "
         f"second step; the cp processes share the machine's cores, so it is not a speed-up "
         f"figure.", "",
         "| cp | tokens per rank | peak MiB | vs cp=1 | plan MiB | plan / peak | step s |",
         "|---|---|---|---|---|---|---|", *rows, ""]
    )  # fmt: skip


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("seq_len", type=int)
    p.add_argument("sizes", help="cp sizes, comma-separated, e.g. 1,2,4")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the sizes")
    p.add_argument("--section", type=Path, default=None, help="write the markdown table here")
    args = p.parse_args()
    sizes = [int(c) for c in args.sizes.split(",")]
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # tools/ and the package of this checkout
    from dropless.bench.common import Recorder

    rec = Recorder.start(argparse.Namespace(no_history=True))
    peaks: dict[str, list[float]] = {str(cp): [] for cp in sizes}
    times: dict[str, list[float]] = {str(cp): [] for cp in sizes}
    for _ in range(args.rounds):
        for cp in sizes:
            res = _measure(args.seq_len, cp)
            ranks = [round(b / 2**20, 1) for _, b, _ in res]
            steps = [round(s, 1) for *_, s in res]
            peaks[str(cp)].append(max(ranks))
            times[str(cp)].append(max(steps))
            print(
                f"seq {args.seq_len} cp={cp}: per-rank peak MiB {ranks}, step s {steps}", flush=True
            )
    plans = {str(cp): round(_planned(args.seq_len, cp) / 2**20, 1) for cp in sizes}
    print(f"plan (MiB, traced peak at gpus = cp): {plans}", flush=True)
    figures = {"seq_len": args.seq_len, "rounds": args.rounds, "peak_mib": peaks, "step_s": times, "plan_mib": plans}  # fmt: skip
    record = rec.finish("cp_memory", figures)
    if args.section:
        args.section.write_text(_section(record, args.seq_len, sizes))


if __name__ == "__main__":
    main()
