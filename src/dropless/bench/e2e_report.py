"""The markdown `dropless bench e2e` prints: the step table and the headline sentences (the
section block of each shape: tools/bench_sections.py)."""

from __future__ import annotations

from .common import paired_text


def table(rows: dict, base: str = "grouped_mm", name=None, trainable: bool = False) -> str:
    """Every row with its ratios against the stock row `base` (`ratios_vs`: same round,
    same AdamW); `name` labels a row's implementation, `trainable` adds its parameters."""
    name, nan, stock = name or label, float("nan"), {"peft": "stock PEFT"}.get(base, "stock")
    lines = [
        f"| implementation | AdamW |{' trainable params |' * trainable} tokens/s median (best "
        "step) | step s | peak step MiB | fwd+bwd / AdamW MiB | vs "
        f"{stock} tokens/s: median of rounds (min-max; best-of-rounds) | vs {stock} peak step "
        "memory | first loss |",
        "|---" * (9 + trainable) + "|",
    ]
    for key, r in rows.items():
        best = r.get("best_tokens_per_s", r["tokens_per_s"])
        mem, peak = r.get(f"memory_vs_{base}"), r.get("peak_step_mib")
        lines.append(
            f"| {name(key.partition('@')[0])} | {r.get('optimizer', 'fused')} |"
            + (f" {r['trainable']:,} |" if trainable else "")
            + f" {r['tokens_per_s']:.0f} ({best:.0f}) | {r['step_s']:.2f} "
            f"| {'-' if peak is None else f'{peak:.1f}'} "
            f"| {r.get('peak_fwd_bwd_mib') or nan:.1f} / {r.get('peak_optimizer_mib') or nan:.1f} "
            f"| {paired_text(r.get(f'vs_{base}'))} | {'-' if mem is None else f'{mem:.2f}x'} "
            f"| {r['first_loss']:.4f} |"
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


def headline(what: str, r: dict | None, base: str, bold: bool = True) -> str:
    """'WHAT: **1.42x tokens/s** (median of 5 paired rounds, 1.30-1.50x; best-of-rounds
    1.45x), **0.61x peak step memory**', from a row's `vs_BASE` ratios; '' without them."""
    vs, b = (r or {}).get(f"vs_{base}"), "**" if bold else ""
    if not vs:
        return ""
    text = (f"{what}: {b}{vs['median']:.2f}x tokens/s{b} (median of {len(vs['rounds'])} paired "
            f"rounds, {vs['min']:.2f}-{vs['max']:.2f}x; best-of-rounds {vs['best']:.2f}x)")  # fmt: skip
    mem = r.get(f"memory_vs_{base}")
    return text + ("" if mem is None else f", {b}{mem:.2f}x peak step memory{b}")


def summary(rows: dict, figures: dict) -> str:
    """One line per AdamW setting: dropless (and the fused loss) against stock, and per
    compiled row its ratios against stock compiled and against its own eager row."""
    lines = []
    for opt in dict.fromkeys(r.get("optimizer", "fused") for r in rows.values()):
        at = "" if opt == "fused" else f"@{opt}"
        parts = [
            headline(f"AdamW {opt}: dropless vs stock default (`grouped_mm`)",
                     rows.get(f"dropless{at}"), "grouped_mm"),
            headline("with `fused_cross_entropy=True`", rows.get(f"dropless-fused-ce{at}"),
                     "grouped_mm", bold=False),
        ]  # fmt: skip
        for impl in ("dropless+compile", "dropless-fused-ce+compile"):
            r = rows.get(impl + at)
            parts.append(headline(f"`{impl}` vs stock compiled", r, "grouped_mm", bold=False))
            own = figures.get(f"{impl}{at}_vs_eager")
            parts.append(f"vs its own eager row: {paired_text(own)}" if own else "")
        lines.append("; ".join(p for p in parts if p))
    return "  \n".join(line + "." for line in lines if line)
