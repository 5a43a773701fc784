"""Where a step's time goes: one step under torch.profiler, as a per-kernel table (run from
a checkout, not in the wheel: `bench.common.from_checkout`).

`dropless bench layer --profile` profiles one bf16 and one FP8 layer step (`dropless`
and `dropless-fp8-current-row`) and `dropless bench e2e --profile` one training step each of
the stock `grouped_mm` and the `dropless` rows, side by side (`side_by_side`); the tables go
to the bench's JSON record (`figures.profile`) and its markdown. On CUDA a row is a GPU
kernel (its device time; the kernels' names as the profiler reports them); on CPU, where
there are no kernels, a row is an aten operator and its self CPU time (what the operator
spent outside the operators it called), on every thread: the expert loop's worker threads
run at once, so on CPU the rows can add up to more than the step's wall time (`wall_ms`,
beside them). The shares are of the rows' sum, so on each device they add up to 1.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from torch._C._profiler import _ExperimentalConfig

TOP = 25  # rows kept; the rest are summed into one "(other)" row


def kernel_table(step: Callable[[], object], device: str, warmup: int = 1, top: int = TOP) -> dict:
    """Run `step` `warmup` times, then once under the profiler -> {device, what, total_ms,
    rows: [{name, calls, total_ms, share}]}, the rows by time, largest first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # every thread's operators: on CPU the expert loop runs on worker threads
    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=acts, experimental_config=config) as prof:
        start = time.perf_counter()
        step()
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3
    rows = _rows(prof.key_averages(), cuda)
    what = "CUDA kernels, device time" if cuda else "aten operators, self CPU time of every thread"
    return _table(rows, top) | {"device": device, "what": what, "wall_ms": round(wall_ms, 1)}


def _rows(averages, cuda: bool) -> list[tuple[str, int, float]]:
    """(name, calls, ms) of each kernel (CUDA) or aten operator (CPU)."""
    out = []
    for ev in averages:
        if cuda:
            # kernel events are the device-side entries; their device time is their own
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.self_device_time_total
        else:
            if not ev.key.startswith("aten::"):
                continue
            us = ev.self_cpu_time_total
        if us > 0:
            out.append((ev.key, ev.count, us / 1e3))
    return sorted(out, key=lambda r: -r[2])


def _table(rows: list[tuple[str, int, float]], top: int) -> dict:
    total = sum(r[2] for r in rows)
    kept, rest = rows[:top], rows[top:]
    if rest:
        kept.append(("(other)", sum(r[1] for r in rest), sum(r[2] for r in rest)))
    return {
        "total_ms": round(total, 4),
        "rows": [
            {"name": n, "calls": c, "total_ms": round(ms, 4), "share": round(ms / total, 4)}
            for n, c, ms in kept
        ],
    }


def markdown(title: str, table: dict) -> str:
    """The table as markdown, under a `#### title` line."""
    lines = [
        f"#### {title}: {table['what']}, {table['total_ms']:.3f} ms in all",
        "",
        "| kernel | calls | total ms | share |",
        "|---|---|---|---|",
    ]
    for r in table["rows"]:
        lines.append(
            f"| `{_op_name(r['name'])}` | {r['calls']} | {r['total_ms']:.3f} | {r['share']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _op_name(name: str) -> str:
    """An operator's name for a markdown cell: pipes escaped, at most 90 characters."""
    name = name.replace("|", "\\|")
    return name[:87] + "..." if len(name) > 90 else name


def side_by_side(title: str, tables: dict[str, dict]) -> str:
    """Several rows' tables as one markdown table, an operator per line (the union of
    each table's kept operators, by their largest time), its ms and share per row."""
    names = list(tables)
    by_row = {n: {r["name"]: r for r in t["rows"]} for n, t in tables.items()}
    ops = sorted(
        {op for rows in by_row.values() for op in rows},
        key=lambda op: (
            op == "(other)",
            -max(rows.get(op, {"total_ms": 0})["total_ms"] for rows in by_row.values()),
        ),
    )
    what = next(iter(tables.values()))["what"]
    total = ", ".join(f"`{n}` {t['total_ms']:.1f} ms in all, step {t.get('wall_ms', '-')} ms wall"
                      for n, t in tables.items())  # fmt: skip
    lines = [
        f"#### {title}, side by side: {what} ({total})",
        "",
        "| operator | " + " | ".join(f"`{n}` ms (share)" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for op in ops:
        cells = [by_row[n].get(op) for n in names]
        text = [f"{c['total_ms']:.1f} ({c['share']:.3f})" if c else "-" for c in cells]
        lines.append(f"| `{_op_name(op)}` | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def layer_steps(build_impl, cfg: dict, names) -> tuple[dict, list[str]]:
    """`dropless bench layer --profile`: one step of each row in `names` (`build_impl` of
    bench/layer.py, uniform routes) under the profiler -> ({T, tables}, their markdown)."""
    tables = {}
    for name in names:
        print(f"T={cfg['T']} profile: {name}", file=sys.stderr, flush=True)
        step, params, _ = build_impl(name, {**cfg, "skewed": False})

        def once(step=step, params=params):
            for p in params:
                p.grad = None
            step()

        tables[name] = kernel_table(once, cfg["device"])
    text = [markdown(f"`{n}` T={cfg['T']}", t) for n, t in tables.items()]
    return {"T": cfg["T"], "tables": tables}, text
