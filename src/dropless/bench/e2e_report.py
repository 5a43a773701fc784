"""The markdown `dropless bench e2e` prints: the step table and the headline sentence (the
section block of each shape: tools/bench_sections.py)."""

from __future__ import annotations


def table(rows: dict) -> str:
    base = rows.get("grouped_mm")
    nan = float("nan")
    lines = [
        "| implementation | tokens/s median (best) | step s | peak step MiB | fwd+bwd / AdamW MiB "
        "| vs grouped_mm tokens/s median (best) | vs grouped_mm peak step memory | first loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for impl, r in rows.items():
        best = r.get("best_tokens_per_s", r["tokens_per_s"])
        speed = mem = "-"
        if base:
            base_best = base.get("best_tokens_per_s", base["tokens_per_s"])
            speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x ({best / base_best:.2f}x)"
            if r.get("peak_step_mib") is not None and base.get("peak_step_mib"):
                mem = f"{r['peak_step_mib'] / base['peak_step_mib']:.2f}x"
        peak = r.get("peak_step_mib")
        lines.append(
            f"| {label(impl)} | {r['tokens_per_s']:.0f} ({best:.0f}) | {r['step_s']:.2f} "
            f"| {'-' if peak is None else f'{peak:.1f}'} "
            f"| {r.get('peak_fwd_bwd_mib') or nan:.1f} / {r.get('peak_optimizer_mib') or nan:.1f} "
            f"| {speed} | {mem} | {r['first_loss']:.4f} |"
        )
    return "\n".join(lines)


def label(impl: str) -> str:
    if impl.endswith("+compile"):
        return label(impl.removesuffix("+compile")) + ", `torch.compile`"
    return {
        "grouped_mm": "HF v5 `grouped_mm` (default)",
        "eager": "HF v5 `eager`",
        "dropless-fused-ce": "HF v5 + `dropless.patch(fused_cross_entropy=True)`",
        "liger": "HF v5 `grouped_mm` + Liger RMSNorm, fused linear CE",
        "liger-moe": "HF v5 + Liger RMSNorm, fused linear CE, fused MoE",
        "cce": "HF v5 `grouped_mm` + Cut Cross-Entropy",
    }.get(impl, "HF v5 + `dropless.patch()`")


def summary(figures: dict) -> str:
    if "speedup_vs_grouped_mm" not in figures:
        return ""
    text = (
        f"dropless vs stock default (`grouped_mm`): **{figures['speedup_vs_grouped_mm']:.2f}x "
        f"tokens/s** median ({figures['best_speedup_vs_grouped_mm']:.2f}x best-of-rounds)"
    )
    if "memory_vs_grouped_mm" in figures:
        text += f", **{figures['memory_vs_grouped_mm']:.2f}x peak step memory**"
    if "fused_ce_speedup_vs_grouped_mm" in figures:
        text += (
            f"; with `fused_cross_entropy=True`: "
            f"{figures['fused_ce_speedup_vs_grouped_mm']:.2f}x tokens/s"
        )
        if "fused_ce_memory_vs_grouped_mm" in figures:
            text += f", {figures['fused_ce_memory_vs_grouped_mm']:.2f}x peak step memory"
    return text + "."
