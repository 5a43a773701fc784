"""The markdown of `dropless bench layer`: each case's table (ms, rate, share of the dense
bound and of the machine's matmul rate, memory) and the lines under them (the measured
matmul rates, each peer row's status)."""

from __future__ import annotations

from .common import paired_text


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _vs(row: dict, base: str) -> str:
    """A row's paired ratio against `base` (the base's own row: 1.00x)."""
    return "1.00x" if row["impl"] == base else paired_text(row.get("paired", {}).get(base))


def table(rows, shape, cfg, busy_core: int | None = None) -> str:
    """One case's rows as the markdown table of the layer section."""
    unit = "TFLOP/s" if cfg["device"] == "cuda" else "GFLOP/s"
    scale = 1e-3 if cfg["device"] == "cuda" else 1.0
    busy = "" if busy_core is None else f", with a busy process pinned to core {busy_core}"
    lines = [
        f"### `{shape}`: E={cfg['E']}, K={cfg['K']}, D={cfg['D']}, F={cfg['F']}, {cfg['dtype']}, "
        f"{cfg['device']}, {cfg['threads']} torch thread(s){busy}",
        "",
        f"| T | routing | implementation | ms (median of rounds) | {unit} "
        "| vs dense bound: median of rounds (min-max; best-of-rounds) | vs matmul rate "
        "| vs HF grouped_mm: median of rounds (min-max; best-of-rounds) | peak MiB "
        "| peak vs HF grouped_mm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        digits = ".0f" if r["ms"] >= 100 else ".2f"  # CPU: hundreds of ms; GPU: a few
        lines.append(
            f"| {r['T']} | {r['routing']} | {r['impl']} | {r['ms']:{digits}} "
            f"| {r['gflops'] * scale:.1f} | {_vs(r, 'dense')} "
            f"| {_fmt(r['share_of_matmul_rate'], '.2f')} | {_vs(r, 'hf-grouped_mm')} "
            f"| {_fmt(r['peak_mib'], '.0f')} | {_fmt(r['mem_vs_hf'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def notes(rates: dict, peer_status: dict) -> str:
    """The lines under the tables: the measured matmul rates and every peer row's status."""
    lines = [
        f"Dense matmul rate, {r['how']}, {r['n']}x{r['n']} {dtype}: {r['tflops'] * 1e3:.1f} "
        f"GFLOP/s ({r['ms']:.3f} ms)."
        for dtype, r in rates.items()
    ]
    for name, st in peer_status.items():
        version = st["version"] or "-"
        lines.append(f"Peer row `{name}` ({st['package']} {version}): {st['status']}.")
    return "\n".join(f"{line}  " for line in lines) + "\n"
