"""Write benchmarks/sections/gpu.md from the log of a `scripts/gpu_check.py` run.

    python scripts/gpu_report.py --run LOG SHA [--run LOG2 SHA2 ...] [--pytest LOG PYTEST_LOG]

Each LOG is the stdout of one `gpu_check.py` run on a GPU machine (its last line is the
JSON summary) and SHA the commit it ran on; the section holds only what the summaries
measured, one subsection per run: each group's status, the layer timing rows and the
end-to-end rows, with the command line, the device and torch version the groups
reported, and the run's date. `--pytest` adds the summary line of a `pytest -m gpu`
run on the machine of that LOG. The logs are kept beside the section (benchmarks/gpu/)
and one line per run goes to benchmarks/history.jsonl.
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


def _summary(log: Path) -> dict:
    for line in reversed(log.read_text().splitlines()):
        if line.startswith('{"gpu_check"'):
            return json.loads(line)["gpu_check"]
    raise SystemExit(f"{log}: no gpu_check summary line (was the run cut short?)")


def _rows(title: str, res: dict, cols: list[str]) -> list[str]:
    out = [f"**{title}**: {res.get('shape')} {res.get('dtype')}", ""]
    out += ["| row | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, row in res.get("rows", {}).items():
        out.append(f"| {name} | " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    return out + [""]


def render_run(s: dict, log: Path, commit: str, command: str, pytest_line: str | None) -> list[str]:
    info = next((g["info"] for g in s["groups"].values() if "info" in g), {})
    when = (
        s.get("date")
        or _DATES.get(log)
        or dt.datetime.fromtimestamp(log.stat().st_mtime, dt.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC (the log file's time)"
        )
    )
    argv = " ".join(s.get("argv", [])) if "argv" in s else None
    cmd = f"python scripts/gpu_check.py {argv}".strip() if argv is not None else command
    lines = [
        f"### `{cmd}` on commit {commit}",
        "",
        f"{info.get('device', '?')}, torch {info.get('torch', '?')}; run {when}; the whole run "
        f"took {s.get('elapsed_s')} s; log `{log.relative_to(ROOT)}`.  ",
        f"Overall: {'every group run passed' if s.get('ok') else 'FAILED: ' + str(s.get('failed'))}.",
        "",
    ]
    if pytest_line:
        lines += [f"`pytest -m gpu` on the same machine: {pytest_line}", ""]
    lines += ["| group | status | checks | seconds |", "|---|---|---|---|"]
    for name, g in s["groups"].items():
        status = g["status"] + (f" ({g['reason']})" if g.get("reason") else "")
        lines.append(f"| {name} | {status} | {_checks(g)} | {g.get('seconds', '')} |")
    lines.append("")
    timing = s["groups"].get("timing", {}).get("timing")
    if timing and "bound" in timing:
        lines += [
            "Layer forward+backward (`dropless bench layer --device cuda`, median of 10 after "
            "3 warm-up steps); the dense bound is that bench's: the experts' six GEMMs with "
            "M = T*K rows as dense `torch.mm`; peak is the step's memory above what was "
            "allocated before it.",
            "",
        ]
    elif timing:
        lines += [
            "Layer forward+backward (CUDA events, median of 10 after 3 warm-up steps); peak is "
            "the step's memory above what was allocated before it. The dense bound of this "
            "run is the script's earlier one: a dense bf16 chain of 5 of the experts' 6 GEMMs "
            "(no input gradient) plus an eager SwiGLU, smaller than `dropless bench layer`'s "
            "six-GEMM bound that later runs use, so `share_of_bound` here reads high.",
            "",
        ]
    if timing:
        cols = ["ms", "share_of_bound", "peak_gib"]
        if any("host_syncs_per_step" in r for r in timing["rows"].values()):
            cols.append("host_syncs_per_step")  # the earlier form measured them here
        cols += [c for c in ("tflops", "share_of_matmul_rate", "version")
                 if any(c in r for r in timing["rows"].values())]  # fmt: skip
        lines += _rows("Layer", timing, cols) + _extras(timing)
    e2e = s["groups"].get("e2e", {}).get("e2e")
    if e2e:
        lines += [
            "Qwen3-MoE training step (forward, backward, fused AdamW; median of 5 after one "
            "warm-up step), stock Transformers `grouped_mm` vs `dropless.patch()` and "
            "`dropless.patch(fused_cross_entropy=True)`; peak is the step's memory above "
            "the weights and optimizer state.",
            "",
        ]
        cols = [
            "ms",
            "tokens_per_s",
            "speed_vs_grouped_mm",
            "peak_step_gib",
            "memory_vs_grouped_mm",
        ]
        if any("version" in r for r in e2e["rows"].values()):
            cols.append("version")
        lines += _rows("End to end", e2e, cols) + _extras(e2e)
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
        ]
        out += ["", "| kernel | calls | total ms | share |", "|---|---|---|---|"]
        out += [f"| `{r['name'][:90].replace('|', '/')}` | {r['calls']} | {r['total_ms']} "
                f"| {r['share']} |" for r in t["rows"]]  # fmt: skip
    if not out:
        return []
    return [line + "  " if line and not line.startswith("|") else line for line in out] + [""]


TRAIN_COLS = [
    "steps", "first_loss", "last_loss", "max_rel_loss_diff", "tokens_per_s",
    "max_memory_allocated_gib", "syncs_forward_per_layer", "syncs_recompute_per_layer",
]  # fmt: skip


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
        "| row | " + " | ".join(TRAIN_COLS) + " |",
        "|---|" + "---|" * len(TRAIN_COLS),
    ]
    for name in ("single", "force_distributed"):
        row = rows.get(name, {})
        out.append(f"| {name} | " + " | ".join(str(row.get(c, "")) for c in TRAIN_COLS) + " |")
    out.append("")
    for name in ("resume", "bench_e2e", "gloo_ep2", "ep_rank_share"):
        if name in rows:
            out.append(f"- {name}: " + ", ".join(f"{k}={v}" for k, v in rows[name].items()))
    return out + [""]


_DATES: dict[Path, str] = {}  # --date LOG WHEN, for a log whose summary has no date


def _checks(g: dict) -> str:
    """A step's checks: ok / all of the script's earlier groups, pytest's counts."""
    if "checks" in g:
        return f"{sum(c.get('status') == 'ok' for c in g['checks'])} / {len(g['checks'])} ok"
    if "counts" in g:
        return ", ".join(f"{v} {k}" for k, v in g["counts"].items())
    return "-"


def render(runs: list[tuple[dict, Path, str, str | None]], command: str, argv: list[str]) -> str:
    lines = [
        "## GPU check (`scripts/gpu_check.py`)",
        "",
        f"Command: `python scripts/gpu_report.py {shlex.join(argv)}`, from the logs of the "
        "`gpu_check.py` runs below (each headed by its command line on the GPU machine). "
        "Each run is on a fresh machine "
        "of the same kind; their spread is the machine-to-machine variation of the figures.",
        "",
    ]
    for s, log, commit, pytest_line in runs:
        lines += render_run(s, log, commit, command, pytest_line)
    return "\n".join(lines)


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
    _DATES.update({Path(a).resolve(): b for a, b in args.date})
    runs = []
    for log_name, commit in args.run:
        log = Path(log_name).resolve()
        pytest_line = None
        if log in pytest_of:
            tail = [ln for ln in pytest_of[log].read_text().splitlines() if " passed" in ln]
            pytest_line = tail[-1].strip() if tail else "no summary line"
        runs.append((_summary(log), log, commit, pytest_line))
    text = render(runs, args.command, argv)
    (ROOT / "benchmarks" / "sections" / "gpu.md").write_text(text + "\n")
    if args.no_history:  # rewriting the section of runs already recorded
        print(text)
        return 0
    with open(ROOT / "benchmarks" / "history.jsonl", "a") as f:
        for s, log, commit, _ in runs:
            record = dict(
                bench="gpu_check", command=args.command, commit=commit,
                log=str(log.relative_to(ROOT)), figures=s,
            )  # fmt: skip
            f.write(json.dumps(record) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
