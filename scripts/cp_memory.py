#!/usr/bin/env python
"""Per-rank peak memory of a training step with context parallelism, on gloo (CPU).

    python scripts/cp_memory.py 65536 1,2,4     # sequence length, then the cp sizes

For each cp size, cp gloo processes (cp = world) train a tiny Qwen3-MoE (hidden 32, 2
layers, 4 experts, fp32, activation checkpointing, batch 1) on one sequence of that
length through the trainer's own micro-batch (`train.step.MicroStep` with the
`ContextSplit`) and optimizer step; the second step is measured with the tracker of the
plan calibration (tests/train/program_memory.py: FSDP2's tracker, the peak of live tensor
bytes). Prints each rank's peak (MiB) and its step time (s).
"""

from __future__ import annotations

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


def main() -> None:
    import torch.multiprocessing as mp

    seq_len, sizes = int(sys.argv[1]), [int(c) for c in sys.argv[2].split(",")]
    for cp in sizes:
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
        peaks = [round(b / 2**20, 1) for _, b, _ in res]
        times = [round(s, 1) for *_, s in res]
        print(f"seq {seq_len} cp={cp}: per-rank peak MiB {peaks}, step s {times}", flush=True)


if __name__ == "__main__":
    main()
