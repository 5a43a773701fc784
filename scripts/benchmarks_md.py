"""Assemble BENCHMARKS.md from benchmarks/sections/*.md.

Every section is written by a `dropless bench` command (its text says which, with the
commit, machine, load and date of the run); this script only concatenates them under a
fixed header, in a fixed order, and names the command for a section that has no run yet.
A section file without a `Command:` line was not written by a generator and is refused.

    python scripts/benchmarks_md.py            # rewrite BENCHMARKS.md
    python scripts/benchmarks_md.py --check    # exit 1 if BENCHMARKS.md is not up to date
"""

from __future__ import annotations

import sys
from pathlib import Path

# section file -> the commands that write it (in the order they are run)
SECTIONS = {
    "layer": [
        "dropless bench layer --shape qwen3 --impls all --record",
        "dropless bench layer --shape mixtral --record",
    ],
    "e2e": [
        "dropless bench e2e --record",
        "dropless bench e2e --shape mixtral --record",
    ],
    "e2e_compile": [
        "dropless bench e2e --impls grouped_mm,dropless --compile --no-memory --no-history "
        "--section benchmarks/sections/e2e_compile.md"
    ],
    "step_bound": [
        "python scripts/bench_step_bound.py --section benchmarks/sections/step_bound.md"
    ],
    "optimizer_step": [
        "python scripts/bench_optimizer_step.py --section benchmarks/sections/optimizer_step.md"
    ],
    "lora": ["dropless bench lora --record"],
    "memory": ["dropless bench memory --seq-len 8192 32768 --record"],
    "fp8": ["dropless bench fp8 --record"],
    "parallel": ["dropless bench ep --world 2 --tokens 1024 --record"],
    "cp": [
        "python scripts/cp_memory.py 65536 1,2,4 --rounds 3 --section benchmarks/sections/cp.md"
    ],
    "train": ["dropless bench train --record"],
    "balance": [
        "OMP_NUM_THREADS=1 python scripts/balance_runs.py per_layer-1thread "
        "per_layer+bias-1thread:train.expert_bias_rate=1e-3",
        "python scripts/balance_runs.py family:train.balance_loss=family per_layer "
        "per_layer-1thread per_layer+bias:train.expert_bias_rate=1e-3 "
        "per_layer+bias-1thread:train.expert_bias_rate=1e-3 --section benchmarks/sections/balance.md",
    ],
    "jax": ["dropless bench jax --impls dropless,ragged_dot,capacity_einsum,dense_bound --record"],
    "expert_mlp_op": [
        "python scripts/bench_expert_mlp_op.py --tokens 1 16384 --rounds 3 "
        "--section benchmarks/sections/expert_mlp_op.md"
    ],
    "commits": ["python scripts/bench_commits.py OLD --section benchmarks/sections/commits.md"],
    "gpu": [
        "python scripts/gpu_check.py (on a GPU machine, output saved as LOG)",
        "python scripts/gpu_report.py --run LOG SHA",
    ],
}
HEADER = """# Benchmarks

Generated: each section below is written by the `dropless bench` command it names (with
the commit, machine, measured load and date of that run), and this file is assembled
from `benchmarks/sections/*.md` by `python scripts/benchmarks_md.py`. Each of those
runs (`--record`) also appended a JSON line (exact command line, commit and dirty flag,
machine, load average and busy processes before and after, figures) to
`benchmarks/history.jsonl`; a `dropless bench` run without `--record` writes no file.
`bash scripts/benchmarks_all.sh` runs every generator in turn and then this assembly;
run it on an otherwise idle machine.

Speed claims are ratios measured side by side in one run on the same machine. A GPU
path without a figure here is unverified.
"""


def build(root: Path) -> str:
    sections = root / "benchmarks" / "sections"
    names = list(SECTIONS) + sorted(p.stem for p in sections.glob("*.md") if p.stem not in SECTIONS)
    parts = [HEADER]
    for name in names:
        path = sections / f"{name}.md"
        if not path.exists():
            cmds = ", ".join(f"`{c}`" for c in SECTIONS[name])
            parts.append(
                f"## `{name}`\n\nNo section yet: {cmds} writes it (figures of earlier runs "
                "are in benchmarks/history.jsonl).\n"
            )
            continue
        text = path.read_text().strip()
        if "Command: `" not in text:
            raise SystemExit(
                f"{path}: no 'Command:' line, so no generator wrote it; regenerate it with "
                f"{' and '.join(SECTIONS.get(name, ['its dropless bench command']))}"
            )
        parts.append(text + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(__file__).resolve().parent.parent
    text = build(root)
    out = root / "BENCHMARKS.md"
    if "--check" in argv:
        if not out.exists() or out.read_text() != text:
            print(
                "BENCHMARKS.md is not assembled from the sections: python scripts/benchmarks_md.py"
            )
            return 1
        return 0
    out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
