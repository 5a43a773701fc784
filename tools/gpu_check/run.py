"""One command for the day a GPU is lent: `pytest -m gpu`, then the timed tables.

    python -m tools.gpu_check           # on the GPU machine, in the checkout
    python scripts/gpu_check.py                  # the same where nothing is installed
    python -m tools.gpu_check --cpu     # the smoke: the same steps on CPU, tiny
    python -m tools.gpu_check --only timing,e2e

Steps, in order, each a child process (a device assert, which poisons the CUDA
context, loses one step): `pytest` runs `pytest -m gpu` (every GPU correctness check
is an ordinary test marked `gpu`; on CPU they are skipped, and the CI suite runs them
under Triton's interpreter); `timing` runs the layer table, `dropless bench layer
--device cuda` at the Qwen3-30B-A3B layer shape (T=16384, bf16), then the JAX layer at the
same shape in a child of its own (row `jax_tiled`, skipped with its reason where jax[cuda]
does not import); `e2e` runs the step
table, `dropless bench e2e --device cuda --shape qwen3-gpu`; `train` runs `dropless train`
on the path a node runs (parallel.force_distributed=true under torchrun on NCCL) at two
Qwen3-30B-A3B layers against the one-process run, with a DCP resume, host syncs per layer,
its tokens/s next to `bench e2e`'s, 2 processes over gloo and one EP rank's share of the
layer (`train.py` of this package says what each row is). A time budget (default 440 s:
with the machine's start a run takes ~10 of the 15 minutes a GPU is lent, leaving room
for one more step with --only) skips the steps that no longer fit and says so: at the
estimates below the first three fit, and `--only train` is the second call.
`./src` is put on the children's path (nothing is installed on the GPU machine). The
last line of the output is one JSON summary, read by outside checks: `gpu_check.date`,
`.argv`, the layer rows at `.groups.timing.timing.rows`, the step rows at
`.groups.e2e.e2e.rows`, the training rows at `.groups.train.train.rows` and their
pass/fail at `.groups.train.train.checks` (row names and fields below and in
`train.py`). Exit status 0 when nothing failed (skipped steps do not fail the run).

Peers: the wheels in ./peers (`--peers DIR`; see BENCHMARKS.md "Peers") are installed
first with `pip install --no-index --no-deps --target TMP`, TMP on the children's path
(`.peers` says what was installed); a peer row runs where its package imports, and each
table's `peers` names every peer row's package, version and status. Both bench steps run
with `--profile`: the per-kernel tables of one bf16 and one FP8 layer step and of one
training step are at `.groups.timing.timing.profile` and `.groups.e2e.e2e.profile`; the
layer table's `matmul` holds the machine's dense matmul rate measured in the same run.
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
from tools.gpu_check import CHECKOUT

ROOT = CHECKOUT
# (step, rough seconds on a GPU machine including the child's start-up; not yet measured for
# the routing, gathered-GEMM and FP8 kernel checks and the peer rows: each compiles its kernels)
STEPS = [("pytest", 150), ("timing", 90), ("e2e", 100), ("train", 200)]
NAMES = [s[0] for s in STEPS]
HANG_FACTOR = 3  # a child running past 3x its estimate is stopped: one hang costs a step
# `dropless bench layer` impl -> the summary's row name
LAYER_ROWS = {
    "dense": "dense_bound",
    "dropless": "dropless",
    "dropless-eager-row-ops": "dropless_eager_row_ops",
    "dropless-fp8-current-row": "dropless_fp8_current_row",
    "dropless-fp8-delayed": "dropless_fp8_delayed",
    "dropless-mxfp8-saved": "dropless_mxfp8_saved",
    "grouped_mm-plain": "grouped_mm_plain",
    "hf-grouped_mm": "hf_grouped_mm",
    "liger-moe": "liger_moe",  # the peers: rows only where their wheels were carried
    "torchao-fp8-row": "torchao_fp8_row",
}
E2E_ROWS = {
    "grouped_mm": "grouped_mm",
    "dropless": "dropless",
    "dropless-fused-ce": "dropless_fused_ce",
    "liger": "liger",
    "liger-moe": "liger_moe",
    "cce": "cut_cross_entropy",
}
# the peers' wheels (`pip download --no-deps`, see BENCHMARKS.md "Peers"), installed with
# `pip install --no-deps --target` into a temporary folder put on the children's path
PEERS_DIR = ROOT / "peers"
PEER_SITE: list[str] = []
LAYER_T = 16384
# the bench command lines: (GPU, --cpu smoke); the smoke times tiny shapes, no memory
LAYER_ARGS = (
    ["--shape", "qwen3-30b", "--tokens", str(LAYER_T), "--device", "cuda", "--rounds", "10",
     "--warmup", "3", "--profile"],
    ["--shape", "tiny", "--device", "cpu", "--rounds", "3", "--warmup", "1", "--no-memory",
     "--profile"],
)  # fmt: skip
E2E_ARGS = (
    ["--shape", "qwen3-gpu", "--device", "cuda", "--rounds", "1", "--steps", "5", "--profile"],
    ["--quick", "--device", "cpu", "--rounds", "1", "--steps", "1", "--no-memory", "--profile"],
)
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


def _peer_fields(record: dict, names: dict) -> dict:
    """{summary row name: {package, version, status}} of the peer rows a bench asked for."""
    return {
        names[impl]: {k: st[k] for k in ("package", "wanted", "version", "status")}
        for impl, st in record["figures"].get("peers", {}).items()
        if impl in names
    }


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


def _round(v, nd=3):
    return None if v is None else round(v, nd)


def layer_table(record: dict) -> dict:
    """The summary's layer table from a `bench layer` record: ms, peak_gib, share_of_bound."""
    rows = {}
    for r in record["figures"]["rows"]:
        if r["routing"] != "uniform" or r["impl"] not in LAYER_ROWS:
            continue
        peak = r["peak_mib"]
        row = rows[LAYER_ROWS[r["impl"]]] = dict(
            ms=_round(r["ms"]), peak_gib=_round(None if peak is None else peak / 1024),
            share_of_bound=_round(r["vs_bound"]), tflops=_round(r["gflops"] / 1e3),
            max_rel_diff=_round(r["max_rel_diff"], 6),
        )  # fmt: skip
        if "share_of_matmul_rate" in r:
            row["share_of_matmul_rate"] = _round(r["share_of_matmul_rate"])
        if "peer" in r:
            row["version"] = r["peer"]["version"]
    dims = dict(record["figures"]["dims"])
    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(dims.pop("dtype"), "?")
    shape = dims | {"T": record["figures"]["rows"][0]["T"]}
    bound = (
        "bench/layer.py's dense bound: exactly the six GEMMs with M = T*K rows as dense "
        "torch.mm (input grad included), no routing, gather, SwiGLU or combine"
    )
    f = record["figures"]
    rates = {k: dict(n=v["n"], tflops=_round(v["tflops"]), how=v["how"])
             for k, v in f.get("matmul", {}).items()}  # fmt: skip
    extra = dict(matmul=rates, peers=_peer_fields(record, LAYER_ROWS), profile=f.get("profile"))
    return dict(shape=shape, dtype=dtype, bound=bound, rows=rows) | extra


def jax_row(table: dict, cpu: bool, timeout: float) -> dict:
    """The JAX layer at the layer table's shape, in a child of its own after the torch rows
    (`tools/jax_layer.py`), against the table's dense bound; where jax[cuda] does
    not import the row says "skipped: jax[cuda] not importable" and why."""
    bound = {k: table["rows"].get("dense_bound", {}).get(k) for k in ("ms", "tflops")}
    cfg = dict(table["shape"], dtype={"bf16": "bfloat16"}.get(table["dtype"], "float32"),
               device="cpu" if cpu else "cuda", rounds=5, warmup=2, bound=bound)  # fmt: skip
    cmd = [sys.executable, "-m", "tools.jax_layer", json.dumps(cfg)]
    status, _, stdout, tail = run_child(cmd, cpu, timeout)
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) if status == "ok" and lines else _no_jax_row(status, tail)
    except json.JSONDecodeError:
        return _no_jax_row("fail", tail)


def _no_jax_row(status: str, why: str) -> dict:
    return dict(status="fail" if status == "ok" else status, ms=None, share_of_bound=None,
                tflops=None, peak_gib=None, reason=why)  # fmt: skip


def e2e_table(record: dict) -> dict:
    """The summary's step table: ms, tokens_per_s, peak_gib (= peak_step_gib), ratios."""
    f = record["figures"]
    rows = {}
    for impl, r in f["rows"].items():
        if impl not in E2E_ROWS:
            continue
        peak = r.get("peak_step_mib")
        gib = None if peak is None else round(peak / 1024, 3)
        rows[E2E_ROWS[impl]] = dict(
            ms=round(r["step_s"] * 1e3, 2), tokens_per_s=round(r["tokens_per_s"]),
            peak_gib=gib, peak_step_gib=gib, first_loss=round(r["first_loss"], 4),
        )  # fmt: skip
        if "peer" in r:
            rows[E2E_ROWS[impl]]["version"] = r["peer"]["version"]
    base = rows.get("grouped_mm", {})
    for r in rows.values():
        r["speed_vs_grouped_mm"] = _ratio(r["tokens_per_s"], base.get("tokens_per_s"))
        r["memory_vs_grouped_mm"] = _ratio(r["peak_gib"], base.get("peak_gib"))
    extra = dict(peers=_peer_fields(record, E2E_ROWS), profile=f.get("profile"))
    return dict(shape=f["shape"], dtype=f.get("dtype", "float32"), rows=rows) | extra


def _ratio(a, b):
    return None if a is None or not b else round(a / b, 3)


def run_step(name: str, cpu: bool, timeout: float) -> dict:
    if name == "pytest":
        return pytest_step(cpu, timeout)
    if name == "timing":
        res, record = bench_step("layer", ["--no-skewed", "--impls", ",".join(LAYER_ROWS),
                                           *LAYER_ARGS[cpu]], cpu, timeout)  # fmt: skip
        if record:
            res["timing"] = layer_table(record)
            res["timing"]["rows"]["jax_tiled"] = jax_row(res["timing"], cpu, min(timeout, JAX_S))
        return res
    if name == "train":
        from tools.gpu_check import train

        return train.run(cpu, timeout, run_child, bench_step)
    res, record = bench_step("e2e", ["--impls", ",".join(E2E_ROWS), *E2E_ARGS[cpu]], cpu, timeout)
    if record:
        res["e2e"] = e2e_table(record)
    return res


def print_tables(summary: dict) -> None:
    """The tables, then one line per step."""
    for group in ("timing", "e2e", "train"):
        res = summary["groups"].get(group, {}).get(group)
        if not res:
            continue
        head = res["model"] if group == "train" else f"{res['shape']} {res['dtype']}"
        print(f"\n{group}: {head}")
        for name, row in res["rows"].items():
            print(f"  {name:28s} " + ", ".join(f"{k}={v}" for k, v in row.items()))
        for name, ok in res.get("checks", {}).items():
            print(f"  check {name:22s} {'ok' if ok else 'FAILED'}")
        for name, st in res.get("peers", {}).items():
            print(f"  peer {name:23s} {st['package']} {st['version'] or '-'}: {st['status']}")
        for dtype, r in (res.get("matmul") or {}).items():
            print(f"  dense matmul rate {dtype}: {r['tflops']} TFLOP/s ({r['how']}, n={r['n']})")
    print()
    for name, g in summary["groups"].items():
        extra = f" ({g['reason']})" if "reason" in g else f" {g.get('counts', '')}"
        print(f"  {name:8s} {g['status']:8s} {g.get('seconds', '')}{extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the smoke: CPU, tiny shapes")
    ap.add_argument("--budget", type=float, default=440.0, help="seconds for all steps")
    ap.add_argument("--only", default="", help=f"comma-separated steps of {NAMES}")
    ap.add_argument(
        "--peers", type=Path, default=PEERS_DIR,
        help="folder of the peers' wheels to install for the bench rows (default ./peers)",
    )  # fmt: skip
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
    print_tables(summary)
    print(json.dumps({"gpu_check": summary}), flush=True)
    return 0 if not failed else 1
