"""Write benchmarks/sections/gpu.md from the logs of `scripts/gpu_check.py` runs.

    python scripts/gpu_report.py --run LOG SHA [--run LOG2 SHA2 ...]

Each LOG is the stdout of one `gpu_check.py` run on a GPU machine (its last line is the
JSON summary) and SHA the commit it ran on. Each run is one block of the section
(`render_run`: its command line, device, torch version and date, then the tables of its
summary, `tables`, which the runner prints too), replacing the block of the same log; the
other runs' blocks are kept (`bench_sections.replace_block`). The logs are kept beside the
section (benchmarks/gpu/) and one line per run goes to benchmarks/history.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.bench_sections import replace_block

ROOT = Path(__file__).resolve().parents[1]  # the checkout
TITLE = """## GPU check (`scripts/gpu_check.py`)

Command: `python scripts/gpu_report.py --run LOG SHA`, once per run below, from the log of
that `gpu_check.py` run (each headed by its command line on the GPU machine). Each run is
on a fresh machine of the same kind; their spread is the machine-to-machine variation of
the figures."""
LAYER_NOTE = (
    "Layer forward+backward (`dropless bench layer --device cuda`, median of 10 after 3 warm-up "
    "steps); the dense bound is that bench's: the experts' six GEMMs with M = T*K rows as dense "
    "`torch.mm`; peak is the step's memory above what was allocated before it."
)
E2E_NOTE = (
    "Qwen3-MoE training step (forward, backward, fused AdamW; median of 5 after one warm-up "
    "step), stock Transformers `grouped_mm` vs `dropless.patch()` and "
    "`dropless.patch(fused_cross_entropy=True)`; peak is the step's memory above the weights "
    "and optimizer state."
)
# (group, title, note, columns always shown, columns shown where a row has them)
BENCH_TABLES = (
    ("timing", "Layer", LAYER_NOTE, ["ms", "share_of_bound", "peak_gib"],
     ["tflops", "share_of_matmul_rate", "version"]),
    ("e2e", "End to end", E2E_NOTE, ["ms", "tokens_per_s", "speed_vs_grouped_mm",
                                     "peak_step_gib", "memory_vs_grouped_mm"], ["version"]),
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


def render_run(s: dict, log: Path, commit: str) -> list[str]:
    """One run's block: its header, then `tables`."""
    info = next((g["info"] for g in s["groups"].values() if "info" in g), {})
    ok = "every group run passed" if s["ok"] else f"FAILED: {s['failed']}"
    cmd = " ".join(["python scripts/gpu_check.py", *s["argv"]])
    return [
        f"### `{cmd}` on commit {commit}",
        "",
        f"{info.get('device', '?')}, torch {info.get('torch', '?')}; run {s['date']}; the whole run "
        f"took {s.get('elapsed_s')} s; log `{log.relative_to(ROOT)}`.  ",
        f"Overall: {ok}.",
        "",
    ] + tables(s)


def tables(s: dict) -> list[str]:
    """A summary's tables: the steps, the layer and step tables, the train step."""
    steps = {}
    for name, g in s["groups"].items():
        status = g["status"] + (f" ({g['reason']})" if g.get("reason") else "")
        counts = ", ".join(f"{v} {k}" for k, v in g.get("counts", {}).items())  # pytest's
        steps[name] = dict(status=status, checks=counts or "-", seconds=g.get("seconds", ""))
    lines = _md(["status", "checks", "seconds"], steps, "group") + [""]
    for group, title, note, cols, optional in BENCH_TABLES:
        res = s["groups"].get(group, {}).get(group)
        if not res:
            continue
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
        "--no-history", action="store_true",
        help="do not append the runs to benchmarks/history.jsonl (they are there already)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    path = ROOT / "benchmarks" / "sections" / "gpu.md"
    for log, commit in args.run:
        log = Path(log).resolve()
        s = _summary(log)
        block = "\n".join(render_run(s, log, commit)).rstrip("\n") + "\n"
        replace_block(
            path,
            log.name,
            f"<!-- gpu:{log.name} -->\n{block}<!-- /gpu:{log.name} -->\n",
            "gpu",
            TITLE,
        )
        if not args.no_history:  # --no-history: rewriting the section of runs already recorded
            with open(ROOT / "benchmarks" / "history.jsonl", "a") as f:
                command = " ".join(["python scripts/gpu_check.py", *s["argv"]])
                record = dict(bench="gpu_check", command=command, commit=commit,
                              log=str(log.relative_to(ROOT)), figures=s)  # fmt: skip
                f.write(json.dumps(record) + "\n")
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
