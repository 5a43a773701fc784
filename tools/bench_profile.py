"""Where a step's time goes: one step under torch.profiler, as a per-kernel table (run from
a checkout, not in the wheel: `bench.common.from_checkout`).

`dropless bench layer --profile` profiles one bf16 and one FP8 layer step (`dropless`
and `dropless-fp8-current-row`) and `dropless bench e2e --profile` one training step of
the `dropless` row; the tables go to the bench's JSON record (`figures.profile`) and its
markdown. On CUDA a row is a GPU kernel (its device time; the kernels' names as the
profiler reports them); on CPU, where there are no kernels, a row is an aten operator
and its self CPU time (what the operator spent outside the operators it called). The
shares are of the rows' sum, so on each device they add up to 1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

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
    with profile(activities=acts) as prof:
        step()
        sync()
    rows = _rows(prof.key_averages(), cuda)
    return _table(rows, top) | {
        "device": device,
        "what": "CUDA kernels, device time" if cuda else "aten operators, self CPU time",
    }


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
        name = r["name"].replace("|", "\\|")
        if len(name) > 90:
            name = name[:87] + "..."
        lines.append(f"| `{name}` | {r['calls']} | {r['total_ms']:.3f} | {r['share']:.3f} |")
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
