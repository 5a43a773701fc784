"""End of a run: plots, summary.json and the summary table with the paths."""

from __future__ import annotations

import json
import math

from ..run.atomic import write_atomic
from .flops import rate
from .metrics import STARVED


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return format(v, spec)


def write_outputs(cfg, run_dir, summary: dict, records: list[dict]) -> None:
    """The plots (when log.plots) and summary.json; the plots' paths go into `summary`."""
    if cfg.log.plots:
        from .plots import plot_expert_load, plot_losses

        summary["plot_loss"] = str(plot_losses(records, run_dir / "loss.png"))
        load = plot_expert_load(records, run_dir / "expert_load.png", summary.get("balancing"))
        summary["plot_expert_load"] = str(load) if load else None
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=1) + "\n")


def _steps(s: dict) -> str:
    skipped = f" ({s['skipped_steps']} skipped: non-finite)" if s.get("skipped_steps") else ""
    stopped = f", interrupted by {s['stopped_by']}" if s.get("interrupted") else ""
    return f"{s['steps']}{skipped}{stopped}"


def _mfu(s: dict) -> str:
    measured = s["peak_source"].startswith("measured")
    return (
        f"{_fmt(s['mfu'], '.1%')} of {rate(s['peak_tflops'])} per process ({s['peak_source']}"
        + ("; the highest measured during the run" if measured else "")
        + ")"
    )


def _load(s: dict) -> str:
    """The last log window's balance: the worst layer's max/mean load, starved experts."""
    starved = s.get("starved_experts")
    below = (
        "" if starved is None else f", {starved} experts below {STARVED:.0%} of their layer's mean"
    )
    how = f" (balancing: {s['balancing']})" if s.get("balancing") else ""
    return f"worst layer max/mean {_fmt(s['max_mean_load'], '.2f')}{below}{how}"


def summary_rows(s: dict) -> list[tuple[str, str]]:
    """The figures of the summary table, one (label, text) per row."""
    unit = s.get("bpb_unit", "byte")  # "base" for the DNA tokenizer
    ratio = (
        s["final_bpb"] / s["initial_bpb"] if s["final_bpb"] and s["initial_bpb"] else float("nan")
    )
    dropped = (
        "dropped: not measured (the experts path records no counts)"
        if s.get("dropped") is None
        else f"dropped {s['dropped']}"
    )
    return [
        ("steps", _steps(s)),
        (
            "wall time",
            f"{s['wall_s']:.1f} s (training {s['train_s']:.1f} s; process CPU time {s['cpu_s']:.1f} s)",
        ),
        (
            "throughput",
            f"{s['tokens_per_s']:,.0f} tokens/s in training steps ({s['tokens_per_s_wall']:,.0f} tokens/s counting "
            f"evaluation and checkpoints), {s['tflops_per_process'] * 1e3:.2f} GFLOP/s per process",
        ),
        ("MFU", _mfu(s)),
        (
            f"held-out bits/{unit}",
            f"{_fmt(s['final_bpb'], '.3f')} (initial {_fmt(s['initial_bpb'], '.3f')}, x{_fmt(ratio, '.2f')}; unigram {unit} model {_fmt(s['unigram_bpb'], '.3f')})",
        ),
        (
            "loss",
            f"train {_fmt(s['final_loss'], '.4f')}, held-out {_fmt(s['final_eval_loss'], '.4f')} nats/token",
        ),
        ("expert load", _load(s) + f", {dropped}"),
        ("peak memory", f"{s['peak_memory_mib']:,.0f} MiB"),
    ]


def path_rows(s: dict) -> list[tuple[str, str]]:
    """Where the run's files are, one (label, path) per row (those the run wrote)."""
    paths = [
        ("run dir", s["run_dir"]),
        ("checkpoint", s["checkpoint"]),
        ("metrics", s["metrics"]),
        ("config", s["config"]),
    ]
    optional = (
        ("tensorboard", "tensorboard"),
        ("loss plot", "plot_loss"),
        ("load plot", "plot_expert_load"),
    )
    return paths + [(k, s[v]) for k, v in optional if s.get(v)]


def print_table(rows: list[tuple[str, str]], paths: list[tuple[str, str]]) -> None:
    """The summary as a rich table, or aligned plain lines without rich."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ModuleNotFoundError:
        for k, v in rows + paths:
            print(f"{k:>20}  {v}")
        return
    table = Table(title="dropless train: summary", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    table.add_section()
    for k, v in paths:
        table.add_row(k, v)
    Console().print(table)


def finish_report(cfg, run_dir, summary: dict, records: list[dict]) -> None:
    """Write plots and summary.json into the run directory and print the table (rank 0)."""
    write_outputs(cfg, run_dir, summary, records)
    if cfg.log.progress != "none":
        print_table(summary_rows(summary), path_rows(summary))
