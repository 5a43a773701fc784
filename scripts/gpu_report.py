#!/usr/bin/env python
"""Write benchmarks/sections/gpu.md from the log of a `scripts/gpu_check.py` run.

    python scripts/gpu_report.py LOG --commit SHA [--pytest PYTEST_LOG] [--command CMD]

LOG is the stdout of `gpu_check.py` on the GPU machine (its last line is the JSON
summary); the section holds only what that summary measured: each group's status,
the layer timing rows and the end-to-end rows, with the command, the commit the run
was made on, the device and torch version the groups reported, and the log's date.
`--pytest` adds the summary line of a `pytest -m gpu` run on the same machine. The
log is kept beside the section (benchmarks/gpu/) and one line goes to
benchmarks/history.jsonl.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def render(
    s: dict, log: Path, commit: str, command: str, pytest_line: str | None, argv: list[str]
) -> str:
    info = next((g["info"] for g in s["groups"].values() if "info" in g), {})
    when = s.get("date") or dt.datetime.fromtimestamp(
        log.stat().st_mtime, dt.timezone.utc
    ).strftime("%Y-%m-%d %H:%M UTC (the log file's time)")
    lines = [
        "## GPU check (`scripts/gpu_check.py`)",
        "",
        f"Command: `{command}` on the GPU machine; this section: "
        f"`python scripts/gpu_report.py {shlex.join(argv)}`  ",
        f"Commit {commit}; {info.get('device', '?')}, torch {info.get('torch', '?')}; "
        f"run {when}; the whole run took {s.get('elapsed_s')} s.  ",
        f"Overall: {'every group passed' if s.get('ok') else 'FAILED: ' + str(s.get('failed'))}.",
        "",
    ]
    if pytest_line:
        lines += [f"`pytest -m gpu` on the same machine: {pytest_line}", ""]
    lines += ["| group | status | checks (ok / all) | seconds |", "|---|---|---|---|"]
    for name, g in s["groups"].items():
        checks = g.get("checks", [])
        ok = sum(c.get("status") == "ok" for c in checks)
        lines.append(f"| {name} | {g['status']} | {ok} / {len(checks)} | {g.get('seconds', '')} |")
    lines.append("")
    timing = s["groups"].get("timing", {}).get("timing")
    if timing:
        lines += [
            "Layer forward+backward (CUDA events, median of 10 after 3 warm-up steps); the "
            "dense bound is a dense bf16 GEMM chain with the experts' FLOPs; peak is the "
            "step's memory above what was allocated before it.",
            "",
        ]
        lines += _rows("Layer", timing, ["ms", "share_of_bound", "peak_gib", "host_syncs_per_step"])
    e2e = s["groups"].get("e2e", {}).get("e2e")
    if e2e:
        lines += [
            "Qwen3-MoE training step (forward, backward, fused AdamW; median of 5 after one "
            "warm-up step), stock Transformers `grouped_mm` vs `dropless.patch()` and "
            "`dropless.patch(fused_cross_entropy=True)`; peak is the step's memory above "
            "the weights and optimizer state.",
            "",
        ]
        lines += _rows(
            "End to end",
            e2e,
            ["ms", "tokens_per_s", "speed_vs_grouped_mm", "peak_step_gib", "memory_vs_grouped_mm"],
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--commit", required=True, help="the commit the GPU run was made on")
    ap.add_argument("--command", default="python scripts/gpu_check.py")
    ap.add_argument("--pytest", type=Path, default=None, help="log of `pytest -m gpu` there")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    log = args.log.resolve()
    s = _summary(log)
    pytest_line = None
    if args.pytest:
        tail = [ln for ln in args.pytest.read_text().splitlines() if " passed" in ln]
        pytest_line = tail[-1].strip() if tail else "no summary line"
    text = render(s, log, args.commit, args.command, pytest_line, argv)
    (ROOT / "benchmarks" / "sections" / "gpu.md").write_text(text + "\n")
    record = dict(
        bench="gpu_check",
        command=args.command,
        commit=args.commit,
        log=str(log.relative_to(ROOT)),
        figures=s,
    )
    with open(ROOT / "benchmarks" / "history.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
