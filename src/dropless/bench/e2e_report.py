"""The markdown of `dropless bench e2e`: the step table, the headline sentence and the
section block of each shape."""

from __future__ import annotations

from pathlib import Path

from .common import provenance, replace_block

TITLE = """## End to end: a Qwen3-MoE training step, stock Transformers v5 vs `dropless.patch()`

Peer rows, on the stock `grouped_mm` model: `liger` (Liger-Kernel 0.8.5's RMSNorm and fused
linear cross-entropy), `liger-moe` (the same and its fused MoE experts), `cce` (Cut
Cross-Entropy 25.1.1's loss on the final hidden states, plus the router auxiliary loss as
stock adds it). They run only from a checkout (tools/peers.py), where their package
imports and CUDA is there; a run names the others with the version it looked for. `--profile`: a per-kernel table (calls, total
ms, share) of one training step of the `dropless` row. A row absent from a table has not
run on that device."""


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


def write_section(path: Path, table: str, record: dict) -> None:
    """Replace this shape's block of the section file (the other shape's block is kept)."""
    f = record["figures"]
    s = f["shape"]
    device = f.get("device", "cpu")
    key = f"{s['num_experts']}e-top{s['num_experts_per_tok']}" + ("-quick" if f["quick"] else "")
    key += "" if device == "cpu" else f"-{device}"
    where = "fp32 on CPU" if device == "cpu" else f"bf16 on {device.upper()}"
    memory = (
        "Peak step memory: separate children, VmHWM minus VmRSS before the step, with glibc "
        "serving blocks >= 128 KiB by mmap from the child's start so RSS follows live tensors."
        if device == "cpu"
        else "Peak step memory: the CUDA caching allocator's max_memory_allocated above "
        "memory_allocated before the step (weights and AdamW state), in the timing child."
    )
    block = "\n".join(
        [
            f"<!-- e2e:{key} -->",
            f"### {s['num_experts']} experts top-{s['num_experts_per_tok']}"
            + ("" if device == "cpu" else f", {device.upper()}"),
            "",
            provenance(record),
            "",
            f"Model (config object, random weights): vocab {s['vocab_size']}, hidden {s['hidden_size']}, "
            f"{s['num_hidden_layers']} layers, {s['num_attention_heads']} heads / {s['num_key_value_heads']} KV "
            f"heads, head_dim {s['head_dim']}, {s['num_experts']} experts top-{s['num_experts_per_tok']}, "
            f"moe_intermediate_size {s['moe_intermediate_size']}, untied embeddings; batch {s['batch']} x seq "
            f"{s['seq']}, {where}, {f['threads']} torch thread(s); forward + backward + "
            f"AdamW ({f['optimizer']}).  ",
            "Timing: each implementation in its own child process under the default allocator, "
            f"order rotated; rounds per implementation {f['rounds_per_impl']}, {f['steps']} timed "
            "step(s) each after a warm-up (median over rounds; best = the fastest step seen). "
            + memory,
            "",
            table,
            "",
            summary(f) + (" (--quick: a tiny smoke shape, not a result.)" if f["quick"] else ""),
            f"<!-- /e2e:{key} -->",
            "",
        ]
    )
    replace_block(path, key, block, "e2e", TITLE)
