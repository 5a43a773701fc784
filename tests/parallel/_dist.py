"""Run a group of checks in real processes (gloo on loopback), one spawn per call.

`run_group(world, checks)` spawns `world` processes; each runs every named check
and writes {name: "ok" | traceback} to a JSON file; the parent merges the ranks.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, module, names, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a timeout turns a collective left hanging by another rank's failure into an error
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    mod = importlib.import_module(module)
    results = {}
    for name in names:
        try:
            getattr(mod, name)(rank, world)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def run_group(world: int, module: str, names: list[str]) -> dict[str, str]:
    """{check name: "ok" or the first failing rank's traceback}."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _entry, args=(world, _free_port(), module, names, d), nprocs=world, start_method="spawn"
        )
        merged = {n: "ok" for n in names}
        for r in range(world):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                for n, v in json.load(f).items():
                    if v != "ok" and merged[n] == "ok":
                        merged[n] = f"rank {r}:\n{v}"
    return merged
