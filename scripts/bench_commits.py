"""Two commits side by side on this machine: one MoE layer forward+backward (`bench
layer`'s `dropless` row, qwen3 shape, T=2048) and one training step (`bench e2e`'s
`dropless` row, pinned Qwen3-MoE, fused AdamW), each commit's own code.

    python scripts/bench_commits.py OLD [NEW] [--rounds 5] [--steps 5]
        [--section benchmarks/sections/commits.md]

Both commits are checked out with `git worktree add` in a temporary folder (NEW defaults
to HEAD: a committed tree, never the working tree's uncommitted changes) and run with
this checkout's Python environment, the commit's src/ on PYTHONPATH. Every round runs
each (commit, benchmark) in a fresh child process (`--warmup` untimed steps, then
`--steps` timed ones, their median), the commits' order rotated between rounds; new / old
is the median of the per-round ratios, with their min-max and the best-of-rounds ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # tools/ and the package of this checkout

from tools.bench_sections import provenance  # noqa: E402

from dropless.bench.common import (  # noqa: E402
    Recorder,
    add_round_arguments,
    paired,
    paired_text,
    rotated,
    run_json_child,
    verdict,
)
from dropless.bench.e2e import SHAPE  # noqa: E402

# each commit's own build_impl (bench/layer.py) and e2e child (bench/e2e.py): the same
# calls as far back as these benchmarks go
LAYER_CHILD = """
import json, statistics, sys, time
import torch
from dropless.bench import layer
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
step, params, _ = layer.build_impl("dropless", cfg)
times = []
for i in range(cfg["warmup"] + cfg["steps"]):
    for p in params:
        p.grad = None
    t0 = time.perf_counter()
    step()
    if i >= cfg["warmup"]:
        times.append((time.perf_counter() - t0) * 1e3)
print(json.dumps({"ms": statistics.median(times), "ms_all": times}))
"""
E2E_CHILD = """
import json, sys
from dropless.bench import e2e
print(json.dumps(e2e.child(json.loads(sys.argv[1]))))
"""
LAYER = dict(E=64, K=8, D=1024, F=384, T=2048, dtype="float32", device="cpu", skewed=False)
BENCHES = {  # name: (child code, figure, higher is better, unit)
    "layer": (LAYER_CHILD, "ms", False, "ms, median of the child's steps"),
    "e2e": (E2E_CHILD, "tokens_per_s", True, "tokens/s, median of the child's steps"),
}


def _child(src: Path, bench: str, args: dict) -> float:
    code, figure, _, _ = BENCHES[bench]
    out = run_json_child(["-c", code], args, f"{bench} from {src}", env={"PYTHONPATH": str(src)})
    return float(out[figure])


def measure(srcs: dict, args, rec) -> dict[str, dict[str, dict[int, float]]]:
    """-> {bench: {commit: {round: figure}}}: each (commit, bench) in a fresh child every
    round, the commits' order rotated; the load sampled between rounds."""
    import torch

    threads = torch.get_num_threads()
    child = {
        "layer": LAYER | {"threads": threads, "warmup": args.warmup, "steps": args.steps},
        "e2e": {"shape": SHAPE, "impl": "dropless", "steps": args.steps, "mode": "time",
                "optimizer": "fused"},
    }  # fmt: skip
    got = {b: {name: {} for name in srcs} for b in BENCHES}
    for r in range(args.rounds):
        if r:
            rec.sample_load()
        for bench in BENCHES:
            for name in rotated(list(srcs), r):
                got[bench][name][r] = _child(srcs[name], bench, child[bench])
                print(f"round {r + 1}/{args.rounds} {bench} {name}: {got[bench][name][r]:.1f}",
                      flush=True)  # fmt: skip
    return got


def table(bench: str, values: dict[str, dict[int, float]]) -> tuple[list[str], dict]:
    """One benchmark's markdown and new / old (common.paired over speeds)."""
    _, _, higher, unit = BENCHES[bench]
    speed = {n: {r: v if higher else 1 / v for r, v in vs.items()} for n, vs in values.items()}
    ratio = paired(speed["new"], speed["old"])
    lines = [f"| commit | {unit}, one value per round | median | min-max |", "|---|---|---|---|"]
    for name in ("old", "new"):
        v = list(values[name].values())
        lines.append(f"| {name} | {', '.join(f'{x:.1f}' for x in v)} | "
                     f"{statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} |")  # fmt: skip
    lines += ["", f"Speed of new relative to old: {paired_text(ratio)} (median of the "
              "per-round ratios, min-max; best-of-rounds).", ""]  # fmt: skip
    return lines, ratio


def _commit(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short=12", f"{rev}^{{commit}}"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="the old commit")
    p.add_argument("new", nargs="?", default="HEAD", help="the new commit (default HEAD)")
    add_round_arguments(p)
    p.add_argument("--warmup", type=int, default=1, help="untimed layer steps per child first")
    p.add_argument("--section", type=Path, default=None, help="write the markdown here")
    args = p.parse_args(argv)
    if min(args.rounds, args.steps) < 1:
        p.error("--rounds and --steps must be >= 1")
    rec = Recorder.start(argparse.Namespace(no_history=True))
    commits = {"old": _commit(args.old), "new": _commit(args.new)}
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {}
        try:
            for name, commit in commits.items():
                tree = Path(tmp) / name
                subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit],
                               cwd=ROOT, check=True, capture_output=True)  # fmt: skip
                srcs[name] = tree / "src"
            got = measure(srcs, args, rec)
        finally:
            for src in srcs.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(src.parent)],
                               cwd=ROOT, capture_output=True)  # fmt: skip
    layer, layer_ratio = table("layer", got["layer"])
    e2e, e2e_ratio = table("e2e", got["e2e"])
    result = verdict(args.steps, args.rounds, rec.end_load())
    figures = {
        **commits, "rounds": args.rounds, "steps": args.steps, "verdict": result,
        "layer": {n: list(v.values()) for n, v in got["layer"].items()}, "layer_ratio": layer_ratio,
        "e2e": {n: list(v.values()) for n, v in got["e2e"].items()}, "e2e_ratio": e2e_ratio,
    }  # fmt: skip
    record = rec.finish("commits", figures)
    text = "\n".join(
        ["## Two commits side by side (`scripts/bench_commits.py`)", "",
         provenance(record) + "  ", f"Old commit {commits['old']}, new commit {commits['new']} "
         f"(both committed trees); {args.rounds} rounds, each commit's child fresh each round, "
         f"{args.steps} timed steps per child.", "",
         f"One MoE layer forward+backward (`dropless` row, E=64 K=8 D=1024 F=384 T=2048, fp32, "
         f"{args.warmup} warm-up step(s)):", ""]
        + layer
        + ["Qwen3-MoE training step through `dropless.patch()` (`bench e2e`'s pinned model, "
           "fused AdamW, one warm-up step):", ""]
        + e2e + [result, ""]
    )  # fmt: skip
    print(text)
    if args.section:
        args.section.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
