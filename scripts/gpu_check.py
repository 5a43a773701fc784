#!/usr/bin/env python
"""One command for the day a GPU is lent: correctness of every GPU path, then timing.

    python scripts/gpu_check.py                 # on the GPU machine, from the repo root
    python scripts/gpu_check.py --cpu           # the same checks at small shapes on CPU
    python scripts/gpu_check.py --only fp8,jax  # some groups only

Needs nothing beyond torch (and, for their groups, triton, transformers, jax); `./src`
is put on the path. Each group of checks runs in its own child process, so a device
assert (which poisons the CUDA context) loses only that group. Correctness runs at
small shapes against `dropless.ops.reference` in fp64 on the same device; timing runs
only on a GPU, at the Qwen3-30B-A3B layer shape. A time budget (default 240 s, so a
rerun fits in the ~10 minutes a GPU is lent) skips the groups that no longer fit and
says so. Every check prints its max error and a status; the last line is one JSON
summary. Exit status 0 when nothing failed (skipped groups do not fail the run).
The checks themselves live in `gpu_check_groups.py` beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARK = "GPU-CHECK-RESULT:"

# (group, rough seconds on a GPU machine including the child's start-up, needs triton
# under the interpreter on CPU); run in this order: correctness first, then the timing
# (the figures for BENCHMARKS.md), then the groups whose start-up is slowest
GROUPS = [
    ("gemm_layouts", 15, False),
    ("moe_layer", 15, False),
    ("triton_kernels", 25, True),
    ("fused_mlp", 20, True),
    ("fp8", 20, False),
    ("expert_parallel", 20, False),
    ("timing", 75, False),
    ("e2e", 45, False),
    ("compile", 60, False),
    ("jax", 30, False),
]
HANG_FACTOR = 3  # a child running past 3x its estimate is stopped: one hang costs a group
NAMES = [g[0] for g in GROUPS]


def _child(group: str, cpu: bool, interpret: bool, timeout: float) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "2")
        if interpret:  # read by triton at import: set before the child starts
            env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(HERE / "gpu_check_groups.py"), group] + (["--cpu"] if cpu else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1.0)
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        _echo(out)
        return dict(status="timeout", seconds=round(time.perf_counter() - t0, 1), checks=[])
    _echo(proc.stdout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if not lines:
        tail = (proc.stderr or "")[-3000:]
        print(f"  [{group}] crashed (exit {proc.returncode}):\n{tail}", flush=True)
        return dict(
            status="crashed",
            exit=proc.returncode,
            stderr_tail=tail[-800:],
            seconds=round(time.perf_counter() - t0, 1),
            checks=[],
        )
    res = json.loads(lines[-1][len(MARK) :])
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def _echo(stdout: str) -> None:
    for ln in stdout.splitlines():
        if not ln.startswith(MARK):
            print(ln, flush=True)


def _print_tables(summary: dict) -> None:
    """The figures (timing, e2e) as short tables, then one line per group."""
    for group in ("timing", "e2e"):
        res = summary["groups"].get(group, {}).get(group)
        if not res or not res.get("rows"):
            continue
        print(f"\n{group}: {res.get('shape')} {res.get('dtype')}")
        for name, row in res["rows"].items():
            cells = ", ".join(f"{k}={v}" for k, v in row.items())
            print(f"  {name:28s} {cells}")
    print()
    for name, g in summary["groups"].items():
        bad = [c["name"] for c in g.get("checks", []) if c.get("status") == "fail"]
        extra = f" failed: {bad}" if bad else (f" ({g['reason']})" if "reason" in g else "")
        print(f"  {name:16s} {g['status']:8s} {g.get('seconds', '')}{extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="small shapes on CPU (no timing)")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for all groups")
    ap.add_argument("--only", default="", help=f"comma-separated groups of {NAMES}")
    args = ap.parse_args(argv)
    only = [g for g in args.only.split(",") if g]
    unknown = sorted(set(only) - set(NAMES))
    if unknown:
        ap.error(f"unknown group(s) {unknown}; groups: {NAMES}")
    t_start = time.perf_counter()
    summary: dict = {
        "mode": "cpu" if args.cpu else "gpu",
        "budget_s": args.budget,
        "argv": sys.argv[1:] if argv is None else argv,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "groups": {},
    }
    for name, est, interpret in GROUPS:
        if only and name not in only:
            continue
        left = args.budget - (time.perf_counter() - t_start)
        if name == "timing" and args.cpu:
            summary["groups"][name] = dict(status="skipped", reason="timing runs on a GPU only")
            continue
        if left < est:
            reason = f"budget: needs ~{est} s, {left:.0f} s left (rerun with --only {name})"
            print(f"[{name}] skipped: {reason}", flush=True)
            summary["groups"][name] = dict(status="skipped", reason=reason)
            continue
        print(f"[{name}] running ({left:.0f} s of budget left)", flush=True)
        # the estimates are a GPU machine's: on a (busy) CPU only the budget limits a child
        timeout = left if args.cpu else min(left, HANG_FACTOR * est)
        summary["groups"][name] = _child(name, args.cpu, interpret and args.cpu, timeout)
    failed = [
        n for n, g in summary["groups"].items() if g["status"] in ("fail", "crashed", "timeout")
    ]
    summary["failed"] = failed
    summary["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    summary["ok"] = not failed
    _print_tables(summary)
    print(json.dumps({"gpu_check": summary}), flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
