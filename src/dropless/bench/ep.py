"""`dropless bench ep --world 2 --tokens 1024`: one expert-parallel MoE layer in `world`
gloo processes on this machine (ep = world), with and without chunked overlap: the
forward's time split (dispatch / experts / combine) and the forward+backward wall time.
"""

# T tokens per rank, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from .common import Recorder, add_history_arguments, require_default_allocator, write_section

SETTINGS = (
    ("no overlap, 1 chunk", 1, False),
    ("no overlap, 4 chunks", 4, False),
    ("overlap, 4 chunks", 4, True),
)


def _worker(rank, world, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from dropless.nn import MoE
    from dropless.parallel import ParallelConfig, build_mesh, dispatchers, shard_moe_experts

    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pm = build_mesh(ParallelConfig(ep=world), num_experts=args["experts"])
    torch.manual_seed(0)
    moe = MoE(args["hidden"], args["ffn"], args["experts"], args["top_k"])
    shard_moe_experts(moe, pm)
    disp = dispatchers(moe)[0]
    x = torch.randn(args["tokens"], args["hidden"], generator=torch.Generator().manual_seed(rank))
    rows = {}
    for name, chunks, overlap in SETTINGS:
        disp.num_chunks, disp.overlap = chunks, overlap
        walls, fwds, splits = [], [], []
        for i in range(args["warmup"] + args["rounds"]):
            dist.barrier()
            disp.pop_stats()
            t0 = time.perf_counter()
            out, aux = moe(x)
            t1 = time.perf_counter()
            (out.square().mean() + aux.lb_loss).backward()
            t2 = time.perf_counter()
            moe.zero_grad(set_to_none=True)
            if i >= args["warmup"]:
                walls.append(t2 - t0)
                fwds.append(t1 - t0)
                splits.append(disp.pop_stats())
        phases = {p: [s[f"{p}_s"] for s in splits] for p in ("dispatch", "expert", "combine")}
        times = {"fwd_bwd": walls, "fwd": fwds} | phases
        rows[name] = {f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}
        rows[name]["bytes_sent_per_step"] = splits[-1]["bytes_sent"]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def run_bench(args: dict) -> dict:
    """Spawn the processes, return rank 0's {setting: figures}."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", str(args["threads"]))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        mp.start_processes(
            _worker,
            args=(args["world"], port, args, out),
            nprocs=args["world"],
            start_method="spawn",
        )
        with open(out) as f:
            return json.load(f)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, default=2, help="processes (= ep)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    add_history_arguments(p, "parallel")


def run(a) -> int:
    """Run the benchmark, print the table, append the figures to the history."""
    keys = ("world", "tokens", "hidden", "ffn", "experts", "top_k", "rounds", "warmup", "threads")
    args = {k: getattr(a, k) for k in keys}
    require_default_allocator("ep")  # the spawned workers inherit this environment
    rec = Recorder.start(a)
    rows = run_bench(args)
    record = rec.finish("parallel_ep_overlap", {"args": args, "rows": rows})
    text = _table(args, rows)
    print(text)
    write_section(a, rec, "parallel", record, text)
    return 0


def _table(args, rows) -> str:
    head = (
        f"ep={args['world']} (gloo, {args['threads']} thread/process), T={args['tokens']}/rank, "
        f"D={args['hidden']}, F={args['ffn']}, E={args['experts']}, K={args['top_k']}, fp32, "
        f"median of {args['rounds']}\n\n"
        "| setting | fwd+bwd ms | fwd ms | fwd dispatch ms | fwd experts ms | fwd combine ms | bytes sent/step (rank 0) |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {n} | {r['fwd_bwd_ms']:.1f} | {r['fwd_ms']:.1f} | {r['dispatch_ms']:.1f} | "
        f"{r['expert_ms']:.1f} | {r['combine_ms']:.1f} | {r['bytes_sent_per_step']:,} |\n"
        for n, r in rows.items()
    )
    return head + body
