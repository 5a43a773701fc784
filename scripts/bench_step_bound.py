"""The pinned e2e step (`dropless bench e2e`'s `qwen3` shape, fp32 CPU) against its floor:
the time its parts take when each runs alone, at the speed torch runs it.

The parts, on operands allocated before the clock starts, each the median of `--steps`
repeats after a warm-up: every GEMM of the step as one dense `torch.mm` (each linear
layer's forward, input gradient and weight gradient: q, k, v and o and the router with
M = batch x seq rows, the LM head too; the experts' gate/up and down with M = batch x seq
x top-k rows, the dense bound of `dropless bench layer`); causal SDPA forward + backward at
the step's [batch, heads, seq, head_dim] (torch's CPU kernel, which stock and patched both
run); and the AdamW step over tensors of the model's parameter shapes. Nothing else counts
(embedding, norms, rotary, SiLU, routing, gathers, the loss, zeroing gradients), so a
step that ran every part at torch's speed would still take longer than its floor, and
stock step / floor is the most such an implementation gains over stock (per-expert GEMMs
that each fit one core can beat the dense bound: docs/performance.md). Each round runs the floor
and the stock and patched steps (`dropless bench e2e`'s timing child, default allocator)
in fresh children, the order rotated; a ratio is the median of the per-round ratios,
min-max beside it.

    python scripts/bench_step_bound.py [--rounds 5] [--steps 5] [--optimizer fused,default] [--section FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # tools/ and the package of this checkout

from dropless.bench.common import (  # noqa: E402
    Recorder,
    add_round_arguments,
    paired,
    rotated,
    run_child,
    run_json_child,
    step_times,
)
from dropless.bench.e2e import OPTIMIZERS, SHAPE  # noqa: E402

STEP_ROWS = ("grouped_mm", "dropless")  # stock Transformers v5 and the same model patched
NAMES = {"grouped_mm": "stock (`grouped_mm`)", "dropless": "`dropless.patch()`"}
PARTS = {  # what each floor part times, as the table names it
    "experts": "expert GEMMs (gate/up, down: forward, input and weight gradients)",
    "attention": "attention projections q, k, v, o (their three GEMMs each)",
    "router": "router GEMMs",
    "lm_head": "LM head GEMMs",
    "sdpa": "causal SDPA forward + backward",
}


def _linear_gemms(torch, m: int, d_in: int, d_out: int, copies: int):
    """-> run(): forward, input gradient and weight gradient of `copies` [d_out, d_in]
    linear layers on [m, d_in] inputs, as dense torch.mm on operands made here."""
    ops = [
        (torch.randn(m, d_in), torch.randn(d_out, d_in), torch.randn(m, d_out))
        for _ in range(copies)
    ]

    def run():
        for x, w, gy in ops:
            torch.mm(x, w.t())  # forward
            torch.mm(gy, w)  # input gradient
            torch.mm(gy.t(), x)  # weight gradient

    return run


def _sdpa(torch, s: dict, layers: int):
    B, H, L, hd = s["batch"], s["num_attention_heads"], s["seq"], s["head_dim"]
    qkv = [torch.randn(B, H, L, hd, requires_grad=True) for _ in range(3)]
    gy = torch.randn(B, H, L, hd)

    def run():
        for _ in range(layers):
            torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True).backward(gy)

    return run


def _adamw(torch, optimizer: str):
    """-> step(): AdamW over zeros shaped like the stock model's parameters, with gradients."""
    from dropless.bench.e2e import build_row_model

    params = [p.detach().clone() for p in build_row_model("grouped_mm", SHAPE).parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, **OPTIMIZERS[optimizer])
    return opt.step


def floor_child(args: dict) -> dict:
    """The floor's parts in this process: {part: seconds}, each a median of `steps` repeats."""
    import torch

    if args.get("threads"):
        torch.set_num_threads(int(args["threads"]))
    torch.manual_seed(0)
    s, n_layers = SHAPE, SHAPE["num_hidden_layers"]
    T, D = s["batch"] * s["seq"], s["hidden_size"]
    q_out, kv_out = (
        s["num_attention_heads"] * s["head_dim"],
        s["num_key_value_heads"] * s["head_dim"],
    )
    M, F = T * s["num_experts_per_tok"], s["moe_intermediate_size"]
    gate_up, down = _linear_gemms(torch, M, D, 2 * F, 1), _linear_gemms(torch, M, F, D, 1)
    attn = [_linear_gemms(torch, T, D, q_out, 1), _linear_gemms(torch, T, D, kv_out, 2),
            _linear_gemms(torch, T, q_out, D, 1)]  # fmt: skip
    runs = {
        "experts": lambda: [f() for f in (gate_up, down) for _ in range(n_layers)],
        "attention": lambda: [f() for f in attn for _ in range(n_layers)],
        "router": _linear_gemms(torch, T, D, s["num_experts"], n_layers),
        "lm_head": _linear_gemms(torch, T, D, s["vocab_size"], 1),
        "sdpa": _sdpa(torch, s, n_layers),
    }
    for opt in args["optimizers"]:
        runs[f"adamw_{opt}"] = _adamw(torch, opt)
    out = {
        k: statistics.median(step_times(run, args["steps"], warmup=1)) for k, run in runs.items()
    }
    return out | {"threads": torch.get_num_threads()}


def _floor_run(args) -> dict:
    spec = {"steps": args.steps, "threads": args.threads, "optimizers": args.optimizers}
    return run_json_child([str(Path(__file__).resolve()), "--child"], spec, "the floor's child")


def _step_run(impl: str, optimizer: str, args) -> float:
    spec = {"shape": SHAPE, "device": "cpu", "impl": impl, "optimizer": optimizer,
            "steps": args.steps, "threads": args.threads, "mode": "time"}  # fmt: skip
    return run_child("dropless.bench.e2e", spec)["step_s"]


def floor_s(parts: dict, optimizer: str) -> float:
    return sum(parts[k] for k in PARTS) + parts[f"adamw_{optimizer}"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(p, "timed repeats per child after a warm-up")
    p.add_argument("--optimizer", default="fused,default", help="comma list: fused, default")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--section", type=Path, default=None, help="also write the markdown here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(floor_child(json.loads(args.child))))
        return
    from tools.bench_sections import provenance

    args.optimizers = [o for o in args.optimizer.split(",") if o]
    if set(args.optimizers) - {"fused", "default"} or args.rounds < 1 or args.steps < 1:
        raise SystemExit("--optimizer: fused and/or default; --rounds, --steps >= 1")
    rec = Recorder.start(argparse.Namespace(no_history=True))
    rows = ["floor"] + [(impl, o) for o in args.optimizers for impl in STEP_ROWS]
    floors: dict[int, dict] = {}
    steps: dict[tuple, dict[int, float]] = {row: {} for row in rows[1:]}
    for r in range(args.rounds):
        for row in rotated(rows, r):
            if row == "floor":
                floors[r] = _floor_run(args)
                text = ", ".join(f"{k} {v:.3f}" for k, v in floors[r].items() if k != "threads")
            else:
                steps[row][r] = _step_run(*row, args)
                text = f"{row[0]} ({row[1]} AdamW) step {steps[row][r]:.3f} s"
            print(f"round {r + 1}/{args.rounds}: {text}", flush=True)
        rec.sample_load()
    lines = _table(floors, steps, args.optimizers)
    record = rec.finish(
        "step_bound", {"floors": floors, "steps": {f"{i}/{o}": v for (i, o), v in steps.items()}}
    )
    lines += ["", rec.verdict(args.steps, args.rounds)]
    print("\n".join(lines))
    if args.section:
        head = ["## The e2e step against its floor (`scripts/bench_step_bound.py`)", "",
                provenance(record), "", __doc__.split("\n\n")[1].replace("\n", " "), ""]  # fmt: skip
        args.section.write_text("\n".join(head + lines) + "\n")


def _table(floors: dict, steps: dict, optimizers: list) -> list[str]:
    def med(key):
        return statistics.median(f[key] for f in floors.values())

    lines = ["| floor part | ms (median of rounds) |", "|---|---|"]
    lines += [f"| {what} | {med(k) * 1e3:.0f} |" for k, what in PARTS.items()]
    lines += [f"| AdamW step ({o}) | {med(f'adamw_{o}') * 1e3:.0f} |" for o in optimizers]
    lines += ["", "| AdamW | floor s | stock step s | patched step s | stock / floor: the most any "
              "implementation gains over stock | patched / floor | patched vs stock tokens/s |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for o in optimizers:  # speeds are 1 / time: paired(a, b) = b's time / a's time
        floor = {r: 1 / floor_s(f, o) for r, f in floors.items()}
        stock, patched = ({r: 1 / t for r, t in steps[impl, o].items()} for impl in STEP_ROWS)
        cells = [paired(floor, stock), paired(floor, patched), paired(patched, stock)]
        text = [f"{c['median']:.2f}x ({c['min']:.2f}-{c['max']:.2f}x)" for c in cells]
        lines.append(
            f"| {o} | {statistics.median(1 / v for v in floor.values()):.3f} | "
            f"{statistics.median(steps['grouped_mm', o].values()):.3f} | "
            f"{statistics.median(steps['dropless', o].values()):.3f} | " + " | ".join(text) + " |"
        )
    return lines


if __name__ == "__main__":
    main()
