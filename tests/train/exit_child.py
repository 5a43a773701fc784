"""Two-process jobs run to their normal end, each pair of processes forked from this one
after the imports (no torchrun: RANK, WORLD_SIZE and MASTER_ADDR / MASTER_PORT set here),
each process leaving through the interpreter's own shutdown, where a finished run used
to abort (SIGABRT, "terminate called without an active exception").

    python exit_child.py ROOT mesh                                # DTensor work, close_env
    python exit_child.py ROOT train N_RUNS AT_ONCE [dropless train arguments ...]

Prints one JSON line: per job, the exit status of rank 0 and rank 1 (negative: killed by
that signal). Rank r of job i leaves ROOT/i.r.err (its stderr) and ROOT/i.r.threads (the
names of its threads still alive once the job's work returned).
"""

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

MODE = sys.argv[2]
if MODE == "train":  # imported once here, not in every process
    import torch.distributed.checkpoint  # noqa: F401
    import transformers
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    import dropless.hf  # noqa: F401
    from dropless.cli.main import main
    from dropless.train import trainer  # noqa: F401

    transformers.Qwen3MoeForCausalLM  # noqa: B018  (a lazy module: load it before forking)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_left() -> list[str]:
    return sorted((t / "comm").read_text().strip() for t in Path("/proc/self/task").iterdir())


def mesh_job() -> int:
    """The layout `dropless train` builds (dp 2, ep 2), DTensor work that fills torch's
    sharding, redistribute and topology caches, then `close_env`."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from dropless.parallel.mesh import ParallelConfig, build_mesh
    from dropless.train import trainer  # noqa: F401  (what a run has loaded when it closes)
    from dropless.train.run.setup import close_env

    dist.init_process_group("gloo")
    pm = build_mesh(ParallelConfig(ep=2), num_experts=4, device_type="cpu")
    for mesh in (pm.mesh["dp_shard"], pm.expert_mesh["ep"], pm.dp):
        x = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
        y = (x * 2).redistribute(mesh, [Replicate()])
        assert float(y.to_local().sum()) == 24.0
    del pm, mesh, x, y
    close_env()
    return 0


def rank_process(root: Path, i: int, rank: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    os.dup2(os.open(root / f"{i}.{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    if MODE == "mesh":
        code = mesh_job()
    else:
        code = main(["train", "--run-dir", str(root / f"run{i}"), *argv])
    (root / f"{i}.{rank}.threads").write_text(json.dumps(threads_left()))
    sys.exit(code)  # the normal interpreter shutdown (os._exit would hide the abort)


def run_pairs(root: Path, jobs: range, argv: list[str]) -> list[list[int]]:
    """The jobs at the same time (a busy machine is where the abort showed)."""
    pids = []
    for i in jobs:
        port = free_port()
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                rank_process(root, i, rank, port, argv)
            pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return [codes[j : j + 2] for j in range(0, len(codes), 2)]


if __name__ == "__main__":
    root = Path(sys.argv[1])
    n, together = (int(sys.argv[3]), int(sys.argv[4])) if MODE != "mesh" else (1, 1)
    out = []
    for first in range(0, n, together):
        out += run_pairs(root, range(first, min(n, first + together)), sys.argv[5:])
    print(json.dumps(out), flush=True)
