"""`dropless bench lora`: one LoRA fine-tuning step of `bench e2e`'s pinned Qwen3-MoE, PEFT
LoRA r=16 on the experts (`target_parameters`) and the attention (`target_modules`): stock
PEFT (which folds `W + s * B @ A` into each expert weight every forward) against the same
PEFT code after `dropless.patch()` (thin grouped GEMMs inside the expert Function, no
fold), and full fine-tuning for reference. Protocol (fresh children, rotated rounds, AdamW
settings, ratios: median of the per-round ratios against stock PEFT with the same AdamW)
and memory as `bench e2e`.
"""

# B batch, L sequence length

from __future__ import annotations

import argparse
import json
import sys

from . import e2e
from .common import (
    Recorder,
    add_history_arguments,
    load_sentence,
    require_extra,
    write_section,
)
from .e2e import QUICK, SHAPE, build_row_model
from .e2e_report import headline, table

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
    """One row in this process: `bench e2e`'s child with this bench's model."""
    return e2e.child(args, build=build_model)


def _check_args(args) -> list[str]:
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        raise ValueError(f"--impls: unknown {bad}; allowed: {','.join(IMPLS)}")
    if args.rank < 1:
        raise ValueError("--rank must be >= 1")
    return e2e.row_keys(args, impls)


def _table(rows: dict) -> str:
    return table(rows, "peft", LABELS.get, trainable=True)


def _summary(rows: dict) -> str:
    """One line per AdamW setting: PEFT + dropless against stock PEFT."""
    what = "PEFT + dropless vs stock PEFT"
    lines = [headline(f"AdamW {r['optimizer']}: {what}", r, "peft") for r in rows.values()
             if r["impl"] == "peft_dropless"]  # fmt: skip
    return "  \n".join(line + "." for line in lines if line)


def run(args) -> int:
    require_extra("lora", "lora", "transformers", "peft")
    keys = _check_args(args)
    rec = Recorder.start(args)
    shape = QUICK if args.quick else SHAPE
    results = e2e.timing_rounds(args, keys, shape, module="dropless.bench.lora", rec=rec)
    memory = {} if args.no_memory else e2e.memory_runs(args, keys, shape, "dropless.bench.lora")
    rows = e2e.table_rows(results, memory, shape)
    e2e.ratios_vs(rows, "peft")
    for opt in dict.fromkeys(r["optimizer"] for r in rows.values()):
        lora = [r["first_loss"] for r in rows.values() if r["optimizer"] == opt
                and r["impl"] in ("peft", "peft_dropless")]  # fmt: skip
        if len(lora) == 2 and abs(lora[0] - lora[1]) > 1e-3 * abs(lora[0]):
            print(f"WARNING: first-step losses of the LoRA rows differ: {lora}")
    table = _table(rows)
    print(table)
    figures = {
        "shape": shape, "rank": args.rank, "rounds": args.rounds, "steps": args.steps,
        "quick": args.quick, "threads": next(iter(results.values()))[0]["threads"],
        "optimizer": ",".join(dict.fromkeys(r["optimizer"] for r in rows.values())),
        "allocator": "timing: default (no malloc settings); memory: separate children with mallopt",
        "rows": rows,
    }  # fmt: skip
    vs = rows.get("peft_dropless", {}).get("vs_peft")
    if vs:
        figures["speedup_vs_peft"], figures["best_speedup_vs_peft"] = vs["median"], vs["best"]
        if rows["peft_dropless"]["memory_vs_peft"] is not None:
            figures["memory_vs_peft"] = rows["peft_dropless"]["memory_vs_peft"]
    summary = e2e.finish_summary(args, rec, figures, _summary(rows))
    record = rec.finish("lora", figures)
    print(load_sentence(record["load"]))
    write_section(args, rec, "lora", record, table, summary)
    return 0


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
