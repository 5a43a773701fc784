"""Write benchmarks/sections/gpu.md from the log of a `scripts/gpu_check.py` run.

    python scripts/gpu_report.py --run LOG SHA [--run LOG2 SHA2 ...] [--pytest LOG PYTEST_LOG]

Each LOG is the stdout of one `gpu_check.py` run on a GPU machine (its last line is the
JSON summary) and SHA the commit it ran on; the section holds only what the summaries
measured, one subsection per run (`render_run`): its command line, device, torch version
and date, and the tables of its summary (`tables`, which the runner prints too).
`--pytest` adds the summary line of a `pytest -m gpu` run on the machine of that LOG. The
logs are kept beside the section (benchmarks/gpu/) and one line per run goes to
benchmarks/history.jsonl. Summaries of the runner's earlier form (their groups' `checks`
lists, the 5-GEMM bound, `host_syncs_per_step`) render as they were.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

from tools.gpu_check import CHECKOUT

ROOT = CHECKOUT
LAYER_NOTE = (
    "Layer forward+backward (`dropless bench layer --device cuda`, median of 10 after 3 warm-up "
    "steps); the dense bound is that bench's: the experts' six GEMMs with M = T*K rows as dense "
    "`torch.mm`; peak is the step's memory above what was allocated before it."
)
EARLY_LAYER_NOTE = (  # the runner's earlier form, which had no `bound`
    "Layer forward+backward (CUDA events, median of 10 after 3 warm-up steps); peak is the "
    "step's memory above what was allocated before it. The dense bound of this run is the "
    "script's earlier one: a dense bf16 chain of 5 of the experts' 6 GEMMs (no input gradient) "
    "plus an eager SwiGLU, smaller than `dropless bench layer`'s six-GEMM bound that later runs "
    "use, so `share_of_bound` here reads high."
)
E2E_NOTE = (
    "Qwen3-MoE training step (forward, backward, fused AdamW; median of 5 after one warm-up "
    "step), stock Transformers `grouped_mm` vs `dropless.patch()` and "
    "`dropless.patch(fused_cross_entropy=True)`; peak is the step's memory above the weights "
    "and optimizer state."
)
# (group, title, columns always shown, columns shown where a row has them)
BENCH_TABLES = (
    ("timing", "Layer", ["ms", "share_of_bound", "peak_gib"],
     ["host_syncs_per_step", "tflops", "share_of_matmul_rate", "version"]),
    ("e2e", "End to end", ["ms", "tokens_per_s", "speed_vs_grouped_mm", "peak_step_gib",
                           "memory_vs_grouped_mm"], ["version"]),
)  # fmt: skip
TRAIN_COLS = [
    "steps", "first_loss", "last_loss", "max_rel_loss_diff", "tokens_per_s",
    "max_memory_allocated_gib", "syncs_forward_per_layer", "syncs_recompute_per_layer",
]  # fmt: skip


def _summary(log: Path) -> dict:
    for line in reversed(log.read_text().splitlines()):
        if line.startswith('{"gpu_check"'):
            return json.loads(line)["gpu_check"]
    raise SystemExit(f"{log}: no gpu_check summary line (was the run cut short?)")


def _md(cols: list[str], rows: dict, first: str = "row") -> list[str]:
    """{name: {col: value}} as a markdown table, one column per col ("" where absent)."""
    out = [f"| {first} | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    return out + [
        f"| {name} | " + " | ".join(str(row.get(c, "")) for c in cols) + " |"
        for name, row in rows.items()
    ]


def _checks(g: dict) -> str:
    """A step's checks: ok / all of the script's earlier groups, pytest's counts."""
    if "checks" in g:
        return f"{sum(c.get('status') == 'ok' for c in g['checks'])} / {len(g['checks'])} ok"
    if "counts" in g:
        return ", ".join(f"{v} {k}" for k, v in g["counts"].items())
    return "-"


def render_run(
    s: dict, log: Path, commit: str, command: str, pytest_line: str | None, when: str = ""
) -> list[str]:
    """One run's subsection: its header, then `tables`."""
    info = next((g["info"] for g in s["groups"].values() if "info" in g), {})
    when = (
        s.get("date")
        or when
        or dt.datetime.fromtimestamp(log.stat().st_mtime, dt.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC (the log file's time)"
        )
    )
    cmd = f"python scripts/gpu_check.py {' '.join(s['argv'])}".strip() if "argv" in s else command
    ok = "every group run passed" if s.get("ok") else "FAILED: " + str(s.get("failed"))
    lines = [
        f"### `{cmd}` on commit {commit}",
        "",
        f"{info.get('device', '?')}, torch {info.get('torch', '?')}; run {when}; the whole run "
        f"took {s.get('elapsed_s')} s; log `{log.relative_to(ROOT)}`.  ",
        f"Overall: {ok}.",
        "",
    ]
    if pytest_line:
        lines += [f"`pytest -m gpu` on the same machine: {pytest_line}", ""]
    return lines + tables(s)


def tables(s: dict) -> list[str]:
    """A summary's tables: the steps, the layer and step tables, the train step."""
    steps = {
        name: dict(status=g["status"] + (f" ({g['reason']})" if g.get("reason") else ""),
                   checks=_checks(g), seconds=g.get("seconds", ""))
        for name, g in s["groups"].items()
    }  # fmt: skip
    lines = _md(["status", "checks", "seconds"], steps, "group") + [""]
    for group, title, cols, optional in BENCH_TABLES:
        res = s["groups"].get(group, {}).get(group)
        if not res:
            continue
        note = E2E_NOTE if group == "e2e" else LAYER_NOTE if "bound" in res else EARLY_LAYER_NOTE
        cols = cols + [c for c in optional if any(c in r for r in res["rows"].values())]
        lines += [note, "", f"**{title}**: {res.get('shape')} {res.get('dtype')}", ""]
        lines += _md(cols, res.get("rows", {})) + [""] + _extras(res)
    return lines + _train_lines(s["groups"].get("train", {}).get("train"))


def _extras(res: dict) -> list[str]:
    """Under a bench table: the matmul rate measured in the same run, each peer row's
    package, version and status, and the per-kernel tables of its profiled steps."""
    out = [
        f"Dense matmul rate in the same run: {r['tflops']} TFLOP/s ({dtype}, {r['how']}, "
        f"{r['n']}x{r['n']})."
        for dtype, r in (res.get("matmul") or {}).items()
    ]
    out += [
        f"Peer row `{name}`: {st['package']} {st['version'] or '-'} (looked for "
        f"{st['wanted']}): {st['status']}."
        for name, st in (res.get("peers") or {}).items()
    ]
    prof = res.get("profile") or {}
    for name, t in prof.get("tables", prof).items():  # layer: {T, tables}; e2e: {row: table}
        out += [
            "",
            f"Per-kernel time of one `{name}` step ({t['what']}, {t['total_ms']} ms in all):",
            "",
            "| kernel | calls | total ms | share |",
            "|---|---|---|---|",
        ]
        out += [f"| `{r['name'][:90].replace('|', '/')}` | {r['calls']} | {r['total_ms']} "
                f"| {r['share']} |" for r in t["rows"]]  # fmt: skip
    if not out:
        return []
    return [line + "  " if line and not line.startswith("|") else line for line in out] + [""]


def _train_lines(train: dict | None) -> list[str]:
    """The train step: the two runs as a table, the other rows and the checks as lines."""
    if not train:
        return []
    rows = train["rows"]
    checks = ", ".join(f"{k} {'ok' if ok else 'FAILED'}" for k, ok in train["checks"].items())
    out = [
        "`dropless train` on the path a node runs (`tools/gpu_check/train.py`): one process "
        "(`single`) vs `parallel.force_distributed=true` under `torchrun --nproc-per-node 1` "
        f"(`force_distributed`), model `{train['model']}`; checks: {checks}.",
        "",
    ]
    out += _md(TRAIN_COLS, {n: rows.get(n, {}) for n in ("single", "force_distributed")})
    out.append("")
    for name in ("resume", "bench_e2e", "gloo_ep2", "ep_rank_share"):
        if name in rows:
            out.append(f"- {name}: " + ", ".join(f"{k}={v}" for k, v in rows[name].items()))
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--run", nargs=2, action="append", required=True, metavar=("LOG", "COMMIT"),
        help="a gpu_check log and the commit it ran on (repeat for more runs)",
    )  # fmt: skip
    ap.add_argument(
        "--command", default="python scripts/gpu_check.py",
        help="the command line of a run whose log does not record its argv",
    )  # fmt: skip
    ap.add_argument(
        "--pytest", nargs=2, action="append", default=[], metavar=("LOG", "PYTEST_LOG"),
        help="the log of `pytest -m gpu` on the machine of run LOG",
    )  # fmt: skip
    ap.add_argument(
        "--date", nargs=2, action="append", default=[], metavar=("LOG", "WHEN"),
        help="when run LOG ran, for a log whose summary has no date (else the file's mtime)",
    )  # fmt: skip
    ap.add_argument(
        "--no-history", action="store_true",
        help="do not append the runs to benchmarks/history.jsonl (they are there already)",
    )  # fmt: skip
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    pytest_of = {Path(a).resolve(): Path(b) for a, b in args.pytest}
    dates = {Path(a).resolve(): b for a, b in args.date}
    lines = [
        "## GPU check (`scripts/gpu_check.py`)",
        "",
        f"Command: `python scripts/gpu_report.py {shlex.join(argv)}`, from the logs of the "
        "`gpu_check.py` runs below (each headed by its command line on the GPU machine). "
        "Each run is on a fresh machine "
        "of the same kind; their spread is the machine-to-machine variation of the figures.",
        "",
    ]
    runs = [(_summary(Path(log).resolve()), Path(log).resolve(), sha) for log, sha in args.run]
    for s, log, commit in runs:
        pytest_line = None
        if log in pytest_of:
            tail = [ln for ln in pytest_of[log].read_text().splitlines() if " passed" in ln]
            pytest_line = tail[-1].strip() if tail else "no summary line"
        lines += render_run(s, log, commit, args.command, pytest_line, dates.get(log, ""))
    text = "\n".join(lines)
    (ROOT / "benchmarks" / "sections" / "gpu.md").write_text(text + "\n")
    if not args.no_history:  # --no-history: rewriting the section of runs already recorded
        with open(ROOT / "benchmarks" / "history.jsonl", "a") as f:
            for s, log, commit in runs:
                record = dict(
                    bench="gpu_check", command=args.command, commit=commit,
                    log=str(log.relative_to(ROOT)), figures=s,
                )  # fmt: skip
                f.write(json.dumps(record) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
