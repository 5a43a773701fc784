"""One command for the day a GPU is lent: `pytest -m gpu`, then the timed tables.

    python scripts/gpu_check.py [--cpu] [--only timing,e2e]   # --cpu: the smoke, tiny shapes

The steps (`STEPS`), each a child process: `pytest` (`pytest -m gpu`), `timing` (the
layer table of `dropless bench layer` and the JAX row), `e2e` (the step table of
`dropless bench e2e`), `train` (`train.py`). A time budget skips the steps that no longer
fit and says so; the peers' wheels in `--peers` are installed for the children first.
The last line of the output is one JSON summary read by outside checks; exit status 0
when nothing failed. Its rows, fields and checks: docs/kernels.md, "The GPU check".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dropless.bench.child import run_child_process
from tools import gpu_report
from tools.gpu_check import CHECKOUT as ROOT

# (step, rough seconds on a GPU machine including the child's start-up; not yet measured for
# the routing, gathered-GEMM and FP8 kernel checks and the peer rows: each compiles its kernels)
STEPS = [("pytest", 150), ("timing", 90), ("e2e", 100), ("train", 200)]
NAMES = [s[0] for s in STEPS]
HANG_FACTOR = 3  # a child running past 3x its estimate is stopped: one hang costs a step
# the rows each bench step asks for (the peers' rows only where their wheels were carried);
# the summary names a row by its impl with "_" for "-", but for RENAMED
LAYER_IMPLS = (
    "dense", "dropless", "dropless-eager-row-ops", "dropless-fp8-current-row",
    "dropless-fp8-delayed", "dropless-mxfp8-saved", "grouped_mm-plain", "hf-grouped_mm",
    "liger-moe", "torchao-fp8-row",
)  # fmt: skip
E2E_IMPLS = ("grouped_mm", "dropless", "dropless-fused-ce", "liger", "liger-moe", "cce")
RENAMED = {"dense": "dense_bound", "cce": "cut_cross_entropy"}
# summary field: (the bench row's field, scale, digits; None: an integer)
LAYER_FIELDS = {
    "ms": ("ms", 1, 3), "peak_gib": ("peak_mib", 1 / 1024, 3), "share_of_bound": ("vs_bound", 1, 3),
    "tflops": ("gflops", 1e-3, 3), "max_rel_diff": ("max_rel_diff", 1, 6),
    "share_of_matmul_rate": ("share_of_matmul_rate", 1, 3),
}  # fmt: skip
E2E_FIELDS = {
    "ms": ("step_s", 1e3, 2), "tokens_per_s": ("tokens_per_s", 1, None),
    "peak_gib": ("peak_step_mib", 1 / 1024, 3), "peak_step_gib": ("peak_step_mib", 1 / 1024, 3),
    "first_loss": ("first_loss", 1, 4),
}  # fmt: skip
# the peers' wheels (`pip download --no-deps`, see BENCHMARKS.md "Peers"), installed with
# `pip install --no-deps --target` into a temporary folder put on the children's path
PEERS_DIR = ROOT / "peers"
PEER_SITE: list[str] = []
LAYER_T = 16384
# the bench command lines: (GPU, --cpu smoke); the smoke times tiny shapes, no memory
LAYER_ARGS = (
    ["--shape", "qwen3-30b", "--tokens", str(LAYER_T), "--device", "cuda", "--rounds", "1",
     "--steps", "10", "--warmup", "3", "--profile"],
    ["--shape", "tiny", "--device", "cpu", "--rounds", "1", "--steps", "3", "--warmup", "1",
     "--no-memory", "--profile"],
)  # fmt: skip
E2E_ARGS = (
    ["--shape", "qwen3-gpu", "--device", "cuda", "--rounds", "1", "--steps", "5", "--optimizer",
     "fused", "--profile"],
    ["--quick", "--device", "cpu", "--rounds", "1", "--steps", "1", "--optimizer", "fused", "--no-memory", "--profile"],
)  # fmt: skip
PYTEST_PATHS = (["tests"], ["tests/gpu_check"])
JAX_S = 60  # the JAX row's child at most (its compile included): the train step needs the rest


def child_env(cpu: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "src"), *PEER_SITE, env.get("PYTHONPATH", "")]
    )
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "2")
    return env


def run_child(cmd: list[str], cpu: bool, timeout: float) -> tuple[str, int | None, str, str]:
    """-> (status, exit code, stdout, stderr tail); the child's output goes on to this log."""
    print("$ " + " ".join(cmd), flush=True)
    run = run_child_process(cmd, timeout=max(timeout, 1.0), env=child_env(cpu), cwd=ROOT)
    print(run.stdout + run.stderr, flush=True)
    if run.status == "timeout":
        return "timeout", None, run.stdout, (run.stdout + run.stderr)[-800:]
    return run.status, run.returncode, run.stdout, run.stderr[-800:]


def install_peers(src: Path) -> dict:
    """`pip install --no-index --no-deps --target TMP` the peers' wheels carried in `src`;
    TMP goes on the children's PYTHONPATH. Nothing carried: the peer rows say so."""
    wheels = sorted(src.glob("*.whl")) if src.is_dir() else []
    res: dict = dict(dir=str(src), wheels=[w.name for w in wheels])
    if not wheels:
        return res | dict(status="none carried")
    site = tempfile.mkdtemp(prefix="gpu-check-peers-")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--target", site, *map(str, wheels)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return res | dict(status="pip failed", stderr_tail=proc.stderr[-800:])
    PEER_SITE.append(site)
    return res | dict(status="installed", site=site)


def pytest_step(cpu: bool, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    status, code, stdout, _ = run_child(cmd + PYTEST_PATHS[cpu], cpu, timeout)
    if code == 5:  # pytest: nothing collected (no gpu test selected): not a failure
        status = "ok"
    # the last line: "19 passed, 191 deselected in 18.62s"
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    counts = {
        k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", last)
    }
    return dict(status=status, exit=code, counts=counts, summary=last)


def bench_step(bench: str, args: list[str], cpu: bool, timeout: float) -> tuple[dict, dict | None]:
    """Run `dropless bench BENCH ARGS --history TMP` -> (step result, its history record)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        hist = Path(tmp) / "history.jsonl"
        cmd = [sys.executable, "-m", "dropless", "bench", bench, *args, "--history", str(hist)]
        status, code, _, tail = run_child(cmd, cpu, timeout)
        record = json.loads(hist.read_text().splitlines()[-1]) if hist.exists() else None
    res = dict(status=status if record or status != "ok" else "fail", exit=code)
    if record:
        m = record["machine"]
        res["info"] = dict(torch=m["torch"], device=m.get("gpu", "cpu"), commit=record["commit"])
    if status != "ok":
        res["stderr_tail"] = tail
    return res, record


def round_or_none(v, nd=3):
    return None if v is None else round(v, nd)


def _name(impl: str) -> str:
    return RENAMED.get(impl, impl.replace("-", "_"))


def _table(record: dict, rows, impls, fields: dict) -> dict:
    """The summary's rows (named for the summary, in its units) of the bench rows
    `(impl, row)` asked for, and each peer row's package, version and status."""
    out = {}
    for impl, r in rows:
        if impl in impls:
            out[_name(impl)] = {
                k: None if r[src] is None else round(r[src] * scale, nd)
                for k, (src, scale, nd) in fields.items()
                if src in r
            } | ({"version": r["peer"]["version"]} if "peer" in r else {})
    peers = {
        _name(impl): {k: st[k] for k in ("package", "wanted", "version", "status")}
        for impl, st in record["figures"].get("peers", {}).items()
        if impl in impls
    }
    return dict(rows=out, peers=peers, profile=record["figures"].get("profile"))


def layer_table(record: dict) -> dict:
    """The summary's layer table from a `bench layer` record: ms, peak_gib, share_of_bound."""
    f = record["figures"]
    uniform = [(r["impl"], r) for r in f["rows"] if r["routing"] == "uniform"]
    dims = dict(f["dims"])
    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(dims.pop("dtype"), "?")
    bound = "bench/layer.py's: the six GEMMs, M = T*K rows, as dense torch.mm (input grad too)"
    rates = {k: dict(n=v["n"], tflops=round_or_none(v["tflops"]), how=v["how"])
             for k, v in f.get("matmul", {}).items()}  # fmt: skip
    return dict(shape=dims | {"T": f["rows"][0]["T"]}, dtype=dtype, bound=bound, matmul=rates) | (
        _table(record, uniform, LAYER_IMPLS, LAYER_FIELDS)
    )


def e2e_table(record: dict) -> dict:
    """The summary's step table: ms, tokens_per_s, peak_gib (= peak_step_gib), ratios."""
    f = record["figures"]
    t = _table(record, f["rows"].items(), E2E_IMPLS, E2E_FIELDS)
    base = t["rows"].get("grouped_mm", {})
    for r in t["rows"].values():
        for name, key in (("speed", "tokens_per_s"), ("memory", "peak_gib")):
            a, b = r.get(key), base.get(key)
            r[f"{name}_vs_grouped_mm"] = None if a is None or not b else round(a / b, 3)
    return dict(shape=f["shape"], dtype=f.get("dtype", "float32")) | t


def jax_row(table: dict, cpu: bool, timeout: float) -> dict:
    """The JAX layer at the layer table's shape, in a child of its own after the torch rows
    (`tools/jax_layer.py`), against the table's dense bound; where jax[cuda] does
    not import the row says "skipped: jax[cuda] not importable" and why."""
    bound = {k: table["rows"].get("dense_bound", {}).get(k) for k in ("ms", "tflops")}
    cfg = dict(table["shape"], dtype={"bf16": "bfloat16"}.get(table["dtype"], "float32"),
               device="cpu" if cpu else "cuda", rounds=5, warmup=2, bound=bound)  # fmt: skip
    status, _, stdout, tail = run_child(
        [sys.executable, "-m", "tools.jax_layer", json.dumps(cfg)], cpu, timeout
    )
    lines = stdout.strip().splitlines()
    try:
        if status == "ok" and lines:
            return json.loads(lines[-1])
    except json.JSONDecodeError:
        status = "fail"
    return dict(status="fail" if status == "ok" else status, ms=None, share_of_bound=None,
                tflops=None, peak_gib=None, reason=tail)  # fmt: skip


def run_step(name: str, cpu: bool, timeout: float) -> dict:
    if name == "pytest":
        return pytest_step(cpu, timeout)
    if name == "train":
        from tools.gpu_check import train

        return train.run(cpu, timeout, run_child, bench_step)
    bench, impls, args, table = {
        "timing": ("layer", LAYER_IMPLS, ["--no-skewed", *LAYER_ARGS[cpu]], layer_table),
        "e2e": ("e2e", E2E_IMPLS, E2E_ARGS[cpu], e2e_table),
    }[name]
    res, record = bench_step(bench, ["--impls", ",".join(impls), *args], cpu, timeout)
    if record:
        res[name] = table(record)
    if record and name == "timing":
        res[name]["rows"]["jax_tiled"] = jax_row(res[name], cpu, min(timeout, JAX_S))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the smoke: CPU, tiny shapes")
    ap.add_argument("--budget", type=float, default=440.0, help="seconds for all steps")
    ap.add_argument("--only", default="", help=f"comma-separated steps of {NAMES}")
    ap.add_argument("--peers", type=Path, default=PEERS_DIR, help="the peers' wheels (./peers)")
    args = ap.parse_args(argv)
    only = [g for g in args.only.split(",") if g]
    unknown = sorted(set(only) - set(NAMES))
    if unknown:
        ap.error(f"unknown step(s) {unknown}; steps: {NAMES}")
    t_start = time.perf_counter()
    summary: dict = {
        "mode": "cpu" if args.cpu else "gpu", "budget_s": args.budget,
        "argv": sys.argv[1:] if argv is None else argv,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "groups": {},
    }  # fmt: skip
    summary["peers"] = install_peers(args.peers)
    for name, est in STEPS:
        if only and name not in only:
            continue
        left = args.budget - (time.perf_counter() - t_start)
        if left < est * (0.5 if args.cpu else 1.0):
            reason = f"budget: needs ~{est} s, {left:.0f} s left (rerun with --only {name})"
            print(f"[{name}] skipped: {reason}", flush=True)
            summary["groups"][name] = dict(status="skipped", reason=reason)
            continue
        print(f"[{name}] running ({left:.0f} s of budget left)", flush=True)
        t0 = time.perf_counter()
        # the estimates are a GPU machine's: on a (busy) CPU only the budget limits a child
        timeout = left if args.cpu else min(left, HANG_FACTOR * est)
        res = run_step(name, args.cpu, timeout)
        summary["groups"][name] = res | {"seconds": round(time.perf_counter() - t0, 1)}
    failed = [n for n, g in summary["groups"].items() if g["status"] in ("fail", "timeout")]
    summary |= dict(failed=failed, elapsed_s=round(time.perf_counter() - t_start, 1), ok=not failed)
    print("\n".join(gpu_report.tables(summary)), flush=True)  # the tables BENCHMARKS.md shows
    print(json.dumps({"gpu_check": summary}), flush=True)
    return 0 if not failed else 1
