"""The AdamW step after a stock and after a patched backward: the pinned e2e model
(`dropless bench e2e`'s `qwen3` shape, fp32 CPU), the same 47 parameters either way.

Each row (implementation x allocator setting) runs in its own child process, the order
rotated every round; a child takes one warm-up step, then `--steps` steps, timing the
forward + backward and, apart, `opt.step()` + `zero_grad(set_to_none=True)`, with the
minor page faults of the optimizer step (`ru_minflt`) and glibc's heap after the backward
(`mallinfo2`: bytes held in the arenas, and of them free). `--optimizer default` is what
`torch.optim.AdamW(params)` picks on CPU (the single-tensor loop, which allocates two
parameter-sized temporaries per parameter); `fused` is torch's fused kernel. Allocator
settings: `default` (none) and `heap` (`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2**40`:
glibc maps no block and never trims its heap, so a temporary reuses the pages its
predecessor freed; the process keeps its peak mapped). The ratio
is the median of the per-round ratios patched / stock of the optimizer step's time, with
their min-max.

    python scripts/bench_optimizer_step.py [--rounds 5] [--steps 5] [--section FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # tools/ and the package of this checkout

from dropless.bench.common import (  # noqa: E402
    Recorder,
    add_round_arguments,
    paired,
    rotated,
    run_json_child,
)

ROWS = ("grouped_mm", "dropless")  # stock Transformers v5 and the same model patched
SETTINGS = {
    "default": {},
    # no mmap: every block from the heap, which is never trimmed: a freed block stays mapped
    "heap": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)},
}
NAMES = {"grouped_mm": "stock (`grouped_mm`)", "dropless": "`dropless.patch()`"}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _heap_mib() -> tuple[float, float]:
    """glibc's arenas after the backward: (bytes they hold, bytes of them free), MiB."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.arena / 2**20, info.fordblks / 2**20


def child(args: dict) -> dict:
    """One row in this process: the optimizer step's time and page faults, per step."""
    import torch

    from dropless.bench.e2e import SHAPE, build_row_model

    if args.get("threads"):
        torch.set_num_threads(int(args["threads"]))
    model = build_row_model(args["impl"], SHAPE, "cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True}.get(args["optimizer"])  # default: torch picks (CPU: single-tensor)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (SHAPE["batch"], SHAPE["seq"]), generator=g)
    rows = []
    for step in range(args["steps"] + 1):  # step 0: warm-up (AdamW allocates its state)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        t1 = time.perf_counter()
        heap, free = _heap_mib()
        before = resource.getrusage(resource.RUSAGE_SELF)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults = after.ru_minflt - before.ru_minflt
        sys_s = after.ru_stime - before.ru_stime  # the kernel's share: page faults, mmap
        cpu_s = after.ru_utime - before.ru_utime + sys_s
        if step:
            rows.append((t1 - t0, t3 - t2, cpu_s, sys_s, faults, heap, free))
    med = [statistics.median(col) for col in zip(*rows)]
    keys = (
        "fwd_bwd_s",
        "opt_s",
        "opt_cpu_s",
        "opt_sys_s",
        "opt_faults",
        "heap_mib",
        "heap_free_mib",
    )
    return dict(zip(keys, med),
                threads=torch.get_num_threads(), params=len(params))  # fmt: skip


def _run_child(impl: str, setting: str, args) -> dict:
    spec = {"impl": impl, "optimizer": args.optimizer, "steps": args.steps, "threads": args.threads}
    script = [str(Path(__file__).resolve()), "--child"]
    return run_json_child(script, spec, f"child {impl}/{setting}", env=SETTINGS[setting])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(p, "timed steps per child after a warm-up step")
    p.add_argument("--optimizer", choices=("default", "fused"), default="default")
    p.add_argument("--settings", default="default,heap", help="comma list of allocator settings")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--section", type=Path, default=None, help="also write the markdown here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from tools.bench_sections import provenance

    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or args.rounds < 1 or args.steps < 1:
        raise SystemExit(
            f"--settings from {','.join(SETTINGS)}; --rounds, --steps >= 1 ({unknown})"
        )
    rec = Recorder.start(argparse.Namespace(no_history=True))
    rows = [(impl, s) for s in settings for impl in ROWS]
    res: dict[tuple, dict[int, dict]] = {row: {} for row in rows}
    for r in range(args.rounds):
        for impl, s in rotated(rows, r):
            out = res[impl, s][r] = _run_child(impl, s, args)
            print(f"round {r + 1}/{args.rounds} {impl:10s} {s:8s} AdamW {out['opt_s']:.3f} s (cpu {out['opt_cpu_s']:.3f}, sys {out['opt_sys_s']:.3f}), "
                  f"{out['opt_faults']:.0f} faults; fwd+bwd {out['fwd_bwd_s']:.3f} s", flush=True)  # fmt: skip
        rec.sample_load()
    verdict = rec.verdict(args.steps, args.rounds)
    lines = _table(res, rows, settings)
    record = rec.finish("optimizer_step", {"rows": {f"{i}/{s}": v for (i, s), v in res.items()}})
    lines += ["", verdict]
    print("\n".join(lines))
    if args.section:
        head = ["## The AdamW step after a stock and a patched backward "
                "(`scripts/bench_optimizer_step.py`)", "", provenance(record), "",
                __doc__.split("\n\n")[1].replace("\n", " "), ""]  # fmt: skip
        args.section.write_text("\n".join(head + lines) + "\n")


def _table(res: dict, rows: list, settings: list) -> list[str]:
    def med(row, key):
        return statistics.median(o[key] for o in res[row].values())

    lines = [
        "| allocator | row | AdamW step s | page faults per AdamW step | fwd+bwd s | heap after backward MiB (free) |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in rows:
        lines.append(
            f"| {row[1]} | {NAMES[row[0]]} | {med(row, 'opt_s'):.3f} | {med(row, 'opt_faults'):,.0f} | "
            f"{med(row, 'fwd_bwd_s'):.3f} | {med(row, 'heap_mib'):.0f} ({med(row, 'heap_free_mib'):.0f}) |"
        )  # fmt: skip
    lines.append("")
    for s in settings:  # times: higher speed = 1 / time, so the ratio is stock / patched time
        speed = {i: {r: 1 / o["opt_s"] for r, o in res[i, s].items()} for i in ROWS}
        p = paired(speed["grouped_mm"], speed["dropless"])
        lines.append(f"- {s} allocator: patched / stock AdamW step time **{p['median']:.2f}x** "
                     f"(rounds {p['min']:.2f}-{p['max']:.2f}x).")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
