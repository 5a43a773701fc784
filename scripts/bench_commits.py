"""Two commits side by side on this machine: `dropless bench layer` and `bench e2e`
(the dropless row) run alternately from an old commit's sources and from this checkout,
in one process tree, so drift of a shared machine falls on both.

    python scripts/bench_commits.py OLD_COMMIT [--layer-rounds 5] [--e2e-rounds 3]
        [--section benchmarks/sections/commits.md]

The old sources come from `git worktree add` in a temporary folder; both run with this
checkout's Python environment, the old one first on PYTHONPATH. Each invocation is a
whole `dropless bench` run (its own rounds and median); the table gives every
invocation and the median of them per commit, and new / old.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # tools/ and the package of this checkout

from tools.bench_sections import provenance  # noqa: E402

from dropless.bench.common import Recorder  # noqa: E402

LAYER = ["bench", "layer", "--shape", "qwen3", "--rounds", "3", "--impls", "dropless",
         "--no-skewed", "--no-memory"]  # fmt: skip
E2E = ["bench", "e2e", "--impls", "dropless", "--rounds", "3", "--steps", "2", "--no-memory"]
# the dropless row of each table: layer "| T | routing | dropless | ms |", e2e "| ... | tokens/s median (best) |"
LAYER_ROW = re.compile(r"^\| \d+ \| uniform \| dropless \| ([\d.]+) \|", re.M)
E2E_ROW = re.compile(r"^\| HF v5 \+ `dropless\.patch\(\)` \| ([\d.]+) \(", re.M)


def _run(src: Path, args: list[str], row: re.Pattern) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-m", "dropless", *args], env=env, capture_output=True, text=True
    )
    found = row.search(out.stdout)
    if out.returncode or not found:
        raise RuntimeError(
            f"dropless {' '.join(args)} from {src} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        )
    return float(found.group(1))


def _interleaved(srcs: dict, args, row, rounds: int) -> dict[str, list[float]]:
    got = {name: [] for name in srcs}
    for r in range(rounds):
        order = list(srcs) if r % 2 == 0 else list(srcs)[::-1]  # alternate who goes first
        for name in order:
            got[name].append(_run(srcs[name], args, row))
            print(f"{' '.join(args[:2])} round {r + 1} {name}: {got[name][-1]}", flush=True)
    return got


def _table(title: str, unit: str, got: dict, higher_is_better: bool) -> list[str]:
    old, new = statistics.median(got["old"]), statistics.median(got["new"])
    ratio = new / old
    faster = ratio if higher_is_better else 1 / ratio
    lines = [f"{title} ({unit}, one value per invocation):", "",
             "| commit | invocations | median | min-max |", "|---|---|---|---|"]  # fmt: skip
    for name in ("old", "new"):
        v = got[name]
        lines.append(f"| {name} | {', '.join(f'{x:g}' for x in v)} | {statistics.median(v):g} | "
                     f"{min(v):g}-{max(v):g} |")  # fmt: skip
    lines += ["", f"new / old: {ratio:.3f} (speed of new relative to old: {faster:.3f}).", ""]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="the old commit")
    p.add_argument("--layer-rounds", type=int, default=5)
    p.add_argument("--e2e-rounds", type=int, default=3)
    p.add_argument("--section", type=Path, default=None, help="write the markdown here")
    args = p.parse_args(argv)
    rec = Recorder.start(argparse.Namespace(no_history=True))
    old = subprocess.run(["git", "rev-parse", "--short=12", args.old], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), old], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
        try:
            srcs = {"old": tree / "src", "new": ROOT / "src"}
            layer = _interleaved(srcs, LAYER, LAYER_ROW, args.layer_rounds)
            e2e = _interleaved(srcs, E2E, E2E_ROW, args.e2e_rounds)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           capture_output=True)  # fmt: skip
    record = rec.finish("commits", {"old": old, "layer": layer, "e2e": e2e})
    text = "\n".join(
        ["## Two commits side by side (`scripts/bench_commits.py`)", "",
         provenance(record) + "  ", f"Old commit {old}; new: the commit above.", "",
         f"`dropless {' '.join(LAYER)}` (the dropless row, T=2048):", ""]
        + _table("One MoE layer forward+backward", "ms", layer, higher_is_better=False)
        + [f"`dropless {' '.join(E2E)}`:", ""]
        + _table("Qwen3-MoE training step through `dropless.patch()`", "tokens/s median", e2e,
                 higher_is_better=True)
        + [""]
    )  # fmt: skip
    print(text)
    if args.section:
        args.section.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
