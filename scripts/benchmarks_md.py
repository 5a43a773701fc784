"""Rebuild BENCHMARKS.md from benchmarks/sections/*.md (each bench writes its own section)."""

from pathlib import Path

ORDER = ["layer", "e2e", "fp8", "parallel", "train", "jax"]
HEADER = """# Benchmarks

Measured figures only, each with the command that made it; every run also appends a
JSON line (command, commit, machine, date, figures) to `benchmarks/history.jsonl`.
Speed claims are ratios measured side by side in one run on the same machine.

Machine for every table below: 2 x86_64 cores, 24 GiB, no GPU, torch 2.13.0+cpu, fp32,
2026-11-29. These runs shared the 2 cores with other work (several development agents
running tests), so absolute times are noisy; the ratios come from interleaved runs.
**No GPU figure exists yet**: every GPU path (Triton kernels, grouped_mm with device
offsets, row-wise FP8 through torch._scaled_grouped_mm, NCCL, the JAX ragged_dot path)
is unverified.

"""


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    sections = root / "benchmarks" / "sections"
    names = ORDER + sorted(p.stem for p in sections.glob("*.md") if p.stem not in ORDER)
    parts = [HEADER]
    for name in names:
        path = sections / f"{name}.md"
        if path.exists():
            parts.append(path.read_text().strip() + "\n\n")
    (root / "BENCHMARKS.md").write_text("".join(parts).rstrip() + "\n")


if __name__ == "__main__":
    main()
