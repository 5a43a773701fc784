"""The tests' one way to start a child process, a torchrun group and a tiny model, and to
read a run's metrics.

- `run_python(args, env=..., timeout=...)`: `python ARGS` with this checkout's src importable;
  `check=True` fails the test with the child's stderr tail on a non-zero exit.
- `torchrun(nproc, target_args, ...)`: `python -m torch.distributed.run --standalone
  --nproc-per-node N TARGET_ARGS` the same way (`target_args`: `["-m", "dropless", "train",
  ...]` or a script and its arguments); gloo on loopback on CPU. `torchrun_argv(nproc)` and
  `child_env(env)`: its command line and environment, for a child started with Popen.
- `run_group(world, module, names)`: `world` spawned processes in one gloo group on loopback,
  each running the named check functions `module.name(rank, world)`; {name: "ok" or the
  first failing rank's traceback}. One spawn runs many checks: the group's start-up is paid
  once.
- `tiny_moe_config(family, **overrides)`: a tiny random Transformers config of any family
  of `tests/hf/families.py` (no download).
- `tiny_args(*extra)`: `--set` arguments of the tiny run (`recipes.TINY`) and `extra`;
  `finished_run(base, *extra)`: such a run of 8 steps, finished, made in this process (the
  session fixture `finished_run` of tests/train and tests/faults, one per folder so their
  tests spread over the xdist workers); `sub_env()`: the environment of a child a test
  starts itself to inject a fault (one thread, no warnings).
- `read_metrics(run_dir)`: a run's metrics.jsonl records, read by the library;
  `metrics_by_step(run_dir)`: the same records by step.

The checks that run under Triton's interpreter have their own child: `tests/interpreted.py`.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from dropless.train.report.metrics import read_metrics

__all__ = [
    "SRC", "child_env", "finished_run", "metrics_by_step", "read_metrics", "run_python", "sub_env",
    "tiny_args", "tiny_moe_config", "torchrun",
    "torchrun_argv",
]  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
STDERR_TAIL = 3000


def tiny_args(*extra: str) -> list[str]:
    """`--set ITEM` for each item of the tiny run (`recipes.TINY`) and of `extra`."""
    from dropless.train.config.recipes import TINY

    return [a for item in (*TINY, *extra) for a in ("--set", item)]


def finished_run(base: Path, *extra: str) -> Path:
    """A finished 8-step tiny run in `base`/run (checkpoints at 4 and 8, a record every 2
    steps; `extra` overrides), trained in this process on one thread."""
    import torch

    from dropless.cli.main import main

    n, run_dir = torch.get_num_threads(), Path(base) / "run"
    torch.set_num_threads(1)
    try:
        assert main(["train", "--run-dir", str(run_dir), *tiny_args(*extra)]) == 0
    finally:
        torch.set_num_threads(n)
    return run_dir


def sub_env() -> dict[str, str]:
    """os.environ for a child a test starts itself (a fault to inject): one thread, no
    warnings."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def metrics_by_step(run_dir) -> dict[int, dict]:
    """A run's metrics.jsonl records by step, read by the library (`read_metrics`)."""
    return {r["step"]: r for r in read_metrics(run_dir)}


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ with `env` on top (a None value removes the variable) and this
    checkout's src, then its root (the `tools` package), first on PYTHONPATH."""
    out = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    path = [str(SRC), str(ROOT), *filter(None, out.get("PYTHONPATH", "").split(os.pathsep))]
    out["PYTHONPATH"] = os.pathsep.join(path)
    return out


def run_python(
    args, *, env: dict[str, str] | None = None, timeout: float, check: bool = False, **kwargs
) -> subprocess.CompletedProcess:
    """`python ARGS` in a child (this interpreter, text output captured); with `check`, a
    non-zero exit fails with the tail of the child's stderr. `kwargs` go to
    `subprocess.run` (cwd, input, ...)."""
    proc = subprocess.run(
        [sys.executable, *map(str, args)],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-STDERR_TAIL:]
    return proc


def torchrun(
    nproc: int,
    target_args,
    *,
    env: dict[str, str] | None = None,
    timeout: float,
    check: bool = False,
    **kwargs,
) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc-per-node NPROC TARGET_ARGS`,
    as `run_python` runs it."""
    launcher = torchrun_argv(nproc)[1:]
    return run_python([*launcher, *target_args], env=env, timeout=timeout, check=check, **kwargs)


def torchrun_argv(nproc: int) -> list[str]:
    """The command line that starts a torchrun group, for a child the test drives itself
    (`subprocess.Popen([*torchrun_argv(2), ...], env=child_env(...))`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc)]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_entry(rank, world, port, module, names, out_dir):
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
    # a gloo worker thread may still be dropping a finished collective's work and its
    # tensors, which takes the GIL: during interpreter shutdown that aborts the process
    # (std::terminate in ProcessGroupGloo::runLoop, seen after broadcast_object_list);
    # the results are written, so the process leaves without that shutdown
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def run_group(world: int, module: str, names: list[str]) -> dict[str, str]:
    """{check name: "ok" or the first failing rank's traceback}: `world` spawned processes
    (gloo on loopback), each running every named check of `module` in order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _group_entry, args=(world, _free_port(), module, names, d), nprocs=world,
            start_method="spawn",
        )  # fmt: skip
        merged = {n: "ok" for n in names}
        for r in range(world):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                for n, v in json.load(f).items():
                    if v != "ok" and merged[n] == "ok":
                        merged[n] = f"rank {r}:\n{v}"
    return merged


def hf_families():
    """The module `tests/hf/families.py` (the tiny models of every family), importable from
    any folder's tests and their spawned children."""
    hf = str(Path(__file__).resolve().parent / "hf")
    if hf not in sys.path:
        sys.path.append(hf)
    import families

    return families


def tiny_moe_config(family: str = "qwen3_moe", **overrides):
    """A fresh tiny Transformers config of `family` (any of `tests/hf/families.py`:
    FAMILIES, MORE, BLOCK_BIAS), `overrides` set on it."""
    return hf_families().config(family, **overrides)
