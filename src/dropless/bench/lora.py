"""`dropless bench lora`: one LoRA fine-tuning step of `bench e2e`'s pinned Qwen3-MoE, PEFT
LoRA r=16 on the experts (`target_parameters`) and the attention (`target_modules`): stock
PEFT (which folds `W + s * B @ A` into each expert weight every forward) against the same
PEFT code after `dropless.patch()` (thin grouped GEMMs inside the expert Function, no
fold), and full fine-tuning for reference. Protocol and memory as `bench e2e`.
"""

# B batch, L sequence length

from __future__ import annotations

import argparse
import json
import sys

from . import e2e
from .common import Recorder, add_history_arguments, load_sentence, require_extra, write_section
from .e2e import QUICK, SHAPE, build_row_model

IMPLS = ("peft", "peft_dropless", "full", "full_dropless")
DEFAULT_IMPLS = ("peft", "peft_dropless", "full")
RANK = 16
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LABELS = {
    "peft": "stock PEFT LoRA, HF v5 `grouped_mm`",
    "peft_dropless": "PEFT LoRA + `dropless.patch()`",
    "full": "full fine-tuning, HF v5 `grouped_mm`",
    "full_dropless": "full fine-tuning + `dropless.patch()`",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    e2e.add_child_arguments(p)
    p.add_argument("--rank", type=int, default=RANK, help=f"LoRA rank (default {RANK})")
    p.add_argument(
        "--impls", default=",".join(DEFAULT_IMPLS), help=f"comma list from {','.join(IMPLS)}"
    )
    add_history_arguments(p, "lora")


def build_model(impl: str, shape: dict, device: str = "cpu", rank: int = RANK, **_):
    """The row's model: PEFT-wrapped (LoRA rows) or plain (full rows), fp32, train mode."""
    if impl.startswith("peft"):
        import peft  # before patch(): dropless then registers PEFT's factors without a fold
    model = build_row_model("dropless" if impl.endswith("dropless") else "grouped_mm", shape)
    if not impl.startswith("peft"):
        return model
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_parameters=EXPERTS, target_modules=ATTENTION
    )
    return peft.get_peft_model(model, config)


def child(args: dict) -> dict:
    """One row in this process (`bench e2e`'s child with this bench's model): mode "time"
    (default allocator) or "memory"."""
    return e2e.child(args, build=build_model)


def _check_args(args) -> list[str]:
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        raise ValueError(f"--impls: unknown {bad}; allowed: {','.join(IMPLS)}")
    if args.rounds < 1 or args.steps < 1 or args.rank < 1:
        raise ValueError("--rounds, --steps and --rank must be >= 1 (--rounds >= 3 for a result)")
    return impls


def _table(rows: dict) -> str:
    base = rows.get("peft")
    lines = [
        "| row | trainable params | tokens/s median (best) | step s | peak step MiB "
        "| vs stock PEFT tokens/s | vs stock PEFT peak step memory | first loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for impl, r in rows.items():
        speed = mem = "-"
        if base:
            speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"
            if r.get("peak_step_mib") is not None and base.get("peak_step_mib"):
                mem = f"{r['peak_step_mib'] / base['peak_step_mib']:.2f}x"
        peak = r.get("peak_step_mib")
        lines.append(
            f"| {LABELS[impl]} | {r['trainable']:,} | {r['tokens_per_s']:.0f} "
            f"({r['best_tokens_per_s']:.0f}) | {r['step_s']:.2f} "
            f"| {'-' if peak is None else f'{peak:.1f}'} | {speed} | {mem} | {r['first_loss']:.4f} |"
        )
    return "\n".join(lines)


def _summary(rows: dict) -> str:
    d, s = rows.get("peft_dropless"), rows.get("peft")
    if not (d and s):
        return ""
    text = (
        f"PEFT + dropless vs stock PEFT: **{d['tokens_per_s'] / s['tokens_per_s']:.2f}x tokens/s**"
    )
    if d["peak_step_mib"] is not None and s["peak_step_mib"]:
        text += f", **{d['peak_step_mib'] / s['peak_step_mib']:.2f}x peak step memory**"
    return text + "."


def run(args) -> int:
    require_extra("lora", "lora", "transformers", "peft")
    impls = _check_args(args)
    rec = Recorder.start(args)
    shape = QUICK if args.quick else SHAPE
    results = e2e.timing_rounds(args, impls, shape, module="dropless.bench.lora")
    memory = {} if args.no_memory else e2e.memory_runs(args, impls, shape, "dropless.bench.lora")
    rows = e2e.table_rows(results, memory, shape)
    lora = [rows[i]["first_loss"] for i in ("peft", "peft_dropless") if i in rows]
    if len(lora) == 2 and abs(lora[0] - lora[1]) > 1e-3 * abs(lora[0]):
        print(f"WARNING: first-step losses of the LoRA rows differ: {lora}")
    table = _table(rows)
    print(table)
    figures = {
        "shape": shape, "rank": args.rank, "rounds": args.rounds, "steps": args.steps,
        "quick": args.quick, "threads": next(iter(results.values()))[0]["threads"],
        "allocator": "timing: default (no malloc settings); memory: separate children with mallopt",
        "rows": rows,
    }  # fmt: skip
    d, s = rows.get("peft_dropless"), rows.get("peft")
    if d and s:
        figures["speedup_vs_peft"] = d["tokens_per_s"] / s["tokens_per_s"]
        if d["peak_step_mib"] is not None and s["peak_step_mib"]:
            figures["memory_vs_peft"] = d["peak_step_mib"] / s["peak_step_mib"]
    summary = _summary(rows)
    print(summary)
    record = rec.finish("lora", figures)
    print(load_sentence(record["load"]))
    write_section(args, rec, "lora", record, table, summary)
    return 0


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
