"""`dropless bench e2e`: one training step (forward + backward + AdamW) of a Qwen3-MoE
model built from a config object (random weights, no download), stock Transformers v5
(`grouped_mm`, its default, and `eager`) against the same model after `dropless.patch()`.

Each row runs in its own child process, the order rotating every round so that load from
other processes hits them alike. Timing children run under the default allocator: one
warm-up step (AdamW allocates its state), then `--steps` timed steps (tokens/s from the
median). Memory is measured in separate children with glibc told to return freed memory
(`follow_live_memory`, which changes speed: no timing there), so RSS follows the live
tensors; on CUDA the timing child reads the caching allocator. Every child starts from the
same seed, so the first-step losses of the rows must agree. The peer rows run from a
checkout (tools/peers.py); one that cannot run here is named with the version looked for.
"""

# B batch, L sequence length

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from .common import (
    Recorder,
    add_history_arguments,
    follow_live_memory,
    from_checkout,
    load_sentence,
    peak_rss_mib,
    progress,
    require_extra,
    reset_peak_rss,
    rss_mib,
    run_child,
    step_times,
    write_section,
)
from .e2e_report import summary as _summary
from .e2e_report import table as _table

SHAPE = dict(
    vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, num_experts=64, num_experts_per_tok=8,
    moe_intermediate_size=192, intermediate_size=1536, tie_word_embeddings=False,
    batch=4, seq=512,
)  # fmt: skip
QUICK = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, intermediate_size=128, tie_word_embeddings=False,
    batch=2, seq=32,
)  # fmt: skip
# Mixtral-like: 8 experts top-2 with 4x the expert width, so the routed FLOPs per token
# (K * F) equal the 64-expert shape's and the two differ only in how they are grouped
# qwen3-gpu: the pinned CPU shape scaled to a GPU (the GPU tables of scripts/gpu_check.py)
SHAPES = {"qwen3": SHAPE, "mixtral": {**SHAPE, "num_experts": 8, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 768},
          "qwen3-gpu": dict(
    vocab_size=32768, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
    moe_intermediate_size=384, intermediate_size=3072, tie_word_embeddings=False,
    output_router_logits=True, router_aux_loss_coef=0.001, norm_topk_prob=False,
    batch=8, seq=2048),
          # two Qwen3-30B-A3B layers, as scripts/gpu_check.py's train step runs `dropless train`
          # (examples/qwen3-30b-a3b-2layers.toml): tokens/s of the trainer next to this row's
          "qwen3-30b-2l": dict(
    vocab_size=32768, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, intermediate_size=1536, tie_word_embeddings=False,
    batch=1, seq=4096)}  # fmt: skip
# qwen3-gpu with Qwen3's vocabulary: where the LM head and its loss weigh most
SHAPES["qwen3-gpu-v152k"] = {**SHAPES["qwen3-gpu"], "vocab_size": 151936}
PEER_ROWS = ("liger", "liger-moe", "cce")  # tools/peers.py's E2E_ROWS
DEFAULT_IMPLS = ("grouped_mm", "eager", "dropless", "dropless-fused-ce")
IMPLS = (*DEFAULT_IMPLS, *PEER_ROWS)
COMPILED = ("grouped_mm", "dropless", "dropless-fused-ce")  # rows --compile adds a twin of
SUFFIX = "+compile"
PROFILED = "dropless"  # --profile: the row whose step is profiled


def add_child_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the rows' children, `bench e2e`'s and `bench lora`'s."""
    p.add_argument("--rounds", type=int, default=3, help="rounds, each runs every row once (>= 3)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per child (default 2)")
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch threads in each child (default: torch's default, all cores)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny shape for a smoke run (not a result)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory children")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_child_arguments(p)
    p.add_argument(
        "--eager-rounds", type=int, default=None,
        help="rounds that include the slow stock eager row (default: all rounds)",
    )  # fmt: skip
    p.add_argument(
        "--optimizer", choices=("fused", "foreach"), default="fused",
        help="AdamW implementation for every row (default fused: torch's CPU kernel)",
    )  # fmt: skip
    p.add_argument(
        "--impls", default=",".join(DEFAULT_IMPLS),
        help=f"comma list from {','.join(IMPLS)} (the peer rows {','.join(PEER_ROWS)} run from "
        f"a checkout; default: {','.join(DEFAULT_IMPLS)})",
    )  # fmt: skip
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen3",
        help="qwen3: 64 experts top-8 (default); mixtral: 8 experts top-2, same active FLOPs; "
        "qwen3-gpu: qwen3 at a GPU's size (vocab 32768, hidden 1024, batch 8 x 2048); "
        "qwen3-30b-2l: two Qwen3-30B-A3B layers (vocab 32768, batch 1 x 4096); "
        "qwen3-gpu-v152k: qwen3-gpu with Qwen3's vocabulary (151,936)",
    )  # fmt: skip
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default=None,
        help="cpu (fp32) or cuda (bf16; default: cuda when available)",
    )  # fmt: skip
    p.add_argument(
        "--compile", action="store_true",
        help=f"add a torch.compile twin ('<row>{SUFFIX}', inductor) of the {', '.join(COMPILED)} rows",
    )  # fmt: skip
    p.add_argument(
        "--checkpointing", action="store_true",
        help="every row with gradient checkpointing (non-reentrant)",
    )  # fmt: skip
    p.add_argument(
        "--fused-rmsnorm", action="store_true",
        help="the dropless rows with patch(fused_rmsnorm=True) too",
    )  # fmt: skip
    p.add_argument(
        "--profile", action="store_true",
        help=f"one more step of the {PROFILED} row under torch.profiler: a per-kernel table",
    )  # fmt: skip
    add_history_arguments(p, "e2e")


# --- the child: one implementation, one process -----------------------------------------


def build_row_model(
    impl: str, shape: dict, device: str = "cpu", *, checkpointing=False, fused_rmsnorm=False
):
    """The model for one row: fp32 on CPU (bf16 matmul there is ~80x slower), bf16 on CUDA;
    a `+compile` row's under `torch.compile` (inductor, default mode)."""
    import torch
    import transformers as tf

    compiled = impl.endswith(SUFFIX)
    impl = impl.removesuffix(SUFFIX)
    # a shape may set any config key (qwen3-gpu: the router aux loss, as that table had)
    cfg = tf.Qwen3MoeConfig(
        **{"max_position_embeddings": max(shape["seq"], 64), "norm_topk_prob": True}
        | {k: v for k, v in shape.items() if k not in ("batch", "seq")}
    )
    torch.manual_seed(0)
    if impl.startswith("dropless"):
        import dropless

        # the one line: models built afterwards use dropless (fused-ce: loss from
        # dropless.ops.linear_cross_entropy, logits=None, opt-in)
        dropless.patch(fused_cross_entropy=impl == "dropless-fused-ce", fused_rmsnorm=fused_rmsnorm)
        model = tf.AutoModelForCausalLM.from_config(cfg)
        assert model.get_experts_implementation()[""] == "dropless"
    else:
        stock = "grouped_mm" if impl in PEER_ROWS else impl
        model = tf.AutoModelForCausalLM.from_config(cfg, experts_implementation=stock)
    if device == "cuda":
        model = model.to(device=device, dtype=torch.bfloat16).train()
    else:
        model = model.float().train()
    if impl in PEER_ROWS:  # on the model as it will run: its dtype, its device
        from_checkout("peers", f"the row {impl}").apply_e2e(impl, model)
    if checkpointing:  # older Transformers 5 releases name it gradient_checkpointing_enable only
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
    return torch.compile(model) if compiled else model


def child(args: dict, build=build_row_model) -> dict:
    """One implementation in this process: `mode` "time" (default allocator, timed steps)
    or "memory" (mallopt so RSS follows live tensors, peak step memory, no timing); its
    model from `build` (`bench lora`: the LoRA rows, AdamW on the trainable parameters)."""
    import torch

    shape, impl, device = args["shape"], args["impl"], args.get("device", "cpu")
    # memory mode: the allocator policy from the start, before the model's first allocation
    tracked = follow_live_memory() if args.get("mode") == "memory" else None
    if args.get("threads"):
        torch.set_num_threads(int(args["threads"]))
    model = build(
        impl, shape, device, checkpointing=bool(args.get("checkpointing")),
        fused_rmsnorm=bool(args.get("fused_rmsnorm")), **{k: args[k] for k in ("rank",) if k in args},
    )  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: torch's AdamW kernel (fastest, no parameter-sized temporaries);
    # foreach: the default multi-tensor path, whose temporaries are parameter-sized
    fused = args.get("optimizer", "fused") == "fused"
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused, foreach=not fused)
    g = torch.Generator().manual_seed(1)
    ids_BL = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g)
    ids_BL = ids_BL.to(device)

    def fwd_bwd():  # the loss stays a tensor: reading it would sync the device each step
        loss = model(input_ids=ids_BL, labels=ids_BL).loss
        loss.backward()
        return loss.detach()

    def opt_step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    first_loss = float(fwd_bwd())  # warm-up: AdamW state allocated here
    opt_step()
    out = {"impl": impl, "mode": args.get("mode", "time"), "first_loss": first_loss}
    out["trainable"] = sum(p.numel() for p in params)
    out["threads"] = torch.get_num_threads()
    out["malloc_env"] = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    if out["mode"] == "memory":
        out.update(measure_memory(fwd_bwd, opt_step, tracked))
    else:
        sync = torch.cuda.synchronize if device == "cuda" else None
        times = step_times(lambda: (fwd_bwd(), opt_step()), args["steps"], sync=sync)
        out["step_s"], out["best_step_s"] = statistics.median(times), min(times)
        out["tokens_per_s"] = shape["batch"] * shape["seq"] / out["step_s"]
        if device == "cuda":
            out.update(_measure_cuda_memory(fwd_bwd, opt_step))
        if args.get("profile"):
            prof = from_checkout("bench_profile", "--profile")
            out["profile"] = prof.kernel_table(lambda: (fwd_bwd(), opt_step()), device, warmup=0)
    out["dropless_calls"] = None
    if "dropless" in impl and not impl.endswith(SUFFIX):  # compiled calls: not counted
        import dropless.hf.experts as dh

        out["dropless_calls"] = sum(dh.CALLS.values())
    return out


def measure_memory(fwd_bwd, opt_step, tracked: bool) -> dict:
    """Peak RSS above the steady state of one forward+backward and of one AdamW step;
    `follow_live_memory()` must have been called when the process started."""
    follow_live_memory()  # trims the heap again: RSS = live memory from here
    base = rss_mib()
    reset_peak_rss()
    fwd_bwd()
    peak_fb = peak_rss_mib() - base  # activations + gradients
    reset_peak_rss()
    opt_step()
    peak_opt = peak_rss_mib() - base  # gradients + AdamW's temporaries
    return {
        "peak_step_mib": max(peak_fb, peak_opt),
        "peak_fwd_bwd_mib": peak_fb,
        "peak_optimizer_mib": peak_opt,
        "steady_rss_mib": base,
        "memory_tracked": tracked,
    }


def _measure_cuda_memory(fwd_bwd, opt_step) -> dict:
    """Peak CUDA memory above the steady state (weights, AdamW state; no gradients) of
    one forward+backward and of one AdamW step, from the caching allocator's counters."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peaks = []
    for part in (fwd_bwd, opt_step):
        torch.cuda.reset_peak_memory_stats()
        part()
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
    return {
        "peak_step_mib": max(peaks), "peak_fwd_bwd_mib": peaks[0], "peak_optimizer_mib": peaks[1],
        "steady_mib": base / 2**20, "memory_tracked": True,
    }  # fmt: skip


# --- the parent ---------------------------------------------------------------------------


def _check_args(args) -> list[str]:
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    if getattr(args, "compile", False):
        impls += [i + SUFFIX for i in impls if i in COMPILED and i + SUFFIX not in impls]
    bad = [i for i in impls if i.removesuffix(SUFFIX) not in IMPLS]
    bad += [i for i in impls if i.endswith(SUFFIX) and i.removesuffix(SUFFIX) not in COMPILED]
    if bad or not impls:
        allowed = [*IMPLS, *(i + SUFFIX for i in COMPILED)]
        raise ValueError(f"--impls: unknown {bad}; allowed: {','.join(allowed)}")
    if args.rounds < 1 or args.steps < 1:
        raise ValueError("--rounds and --steps must be >= 1 (use --rounds >= 3 for a result)")
    if args.eager_rounds is not None and args.eager_rounds < 1:
        raise ValueError(
            f"--eager-rounds {args.eager_rounds}: must be >= 1 (or drop eager from --impls)"
        )
    return impls


def _common(args, shape: dict, device: str) -> dict:
    """What every child of a run is given (`bench lora`'s LoRA rank too)."""
    keys = ("steps", "optimizer", "threads", "checkpointing", "fused_rmsnorm", "rank")
    return {"shape": shape, "device": device} | {
        k: getattr(args, k) for k in keys if hasattr(args, k)
    }


def timing_rounds(
    args, impls, shape, device="cpu", failed=None, module="dropless.bench.e2e"
) -> dict[str, list[dict]]:
    """Timing children only (default allocator), the order rotated every round. A peer
    row whose child fails is dropped, its error put in `failed`."""
    failed = {} if failed is None else failed
    results: dict[str, list[dict]] = {i: [] for i in impls}
    eager_rounds = getattr(args, "eager_rounds", None)
    for r in range(args.rounds):
        order = impls[r % len(impls) :] + impls[: r % len(impls)]
        if eager_rounds is not None and r >= eager_rounds:
            order = [i for i in order if i != "eager"]
        for impl in order:
            progress(f"round {r + 1}/{args.rounds}: timing {impl} (its own process)")
            if impl in failed:
                continue
            profile = bool(getattr(args, "profile", False)) and impl == PROFILED and r == 0
            child = _common(args, shape, device) | {"impl": impl, "mode": "time"}
            try:
                out = run_child(module, child | {"profile": profile})
            except RuntimeError as e:
                if impl not in PEER_ROWS:
                    raise
                # a peer that breaks on this stack costs its own row, not the table
                failed[impl] = str(e).strip().splitlines()[-1][:300]
                print(f"round {r + 1}/{args.rounds} {impl}: failed ({failed[impl]})", flush=True)
                continue
            results[impl].append(out)
            print(
                f"round {r + 1}/{args.rounds} {impl:14s} {out['tokens_per_s']:8.0f} tokens/s "
                f"step {out['step_s']:.2f} s  loss {out['first_loss']:.4f}",
                flush=True,
            )
    return {i: outs for i, outs in results.items() if i not in failed}


def memory_runs(args, impls, shape, module="dropless.bench.e2e") -> dict[str, dict]:
    """One memory child per implementation (mallopt inside it), separate from timing."""
    out = {}
    for impl in impls:
        progress(f"memory: measuring {impl} (its own process)")
        child = _common(args, shape, "cpu") | {"impl": impl, "mode": "memory", "steps": 0}
        out[impl] = run_child(module, child)
        print(f"memory {impl:14s} peak step {out[impl]['peak_step_mib']:.0f} MiB", flush=True)
    return out


def table_rows(results: dict, memory: dict, shape: dict) -> dict:
    """Each row's speed over its rounds (each a timing child's result): median tokens/s
    and step time, tokens/s of the best step, the first loss, every round's tokens/s; and
    its memory (`memory`: the memory child's, or on CUDA the timing child's)."""
    rows = {}
    for impl, outs in results.items():
        rows[impl] = {
            "tokens_per_s": statistics.median(o["tokens_per_s"] for o in outs),
            "step_s": statistics.median(o["step_s"] for o in outs),
            "best_tokens_per_s": shape["batch"]
            * shape["seq"]
            / min(o["best_step_s"] for o in outs),
            "first_loss": outs[0]["first_loss"],
            "rounds": [o["tokens_per_s"] for o in outs],
            "trainable": outs[0].get("trainable"),
        }
        for k in ("peak_step_mib", "peak_fwd_bwd_mib", "peak_optimizer_mib", "memory_tracked"):
            rows[impl][k] = memory.get(impl, {}).get(k)
    return rows


def run(args) -> int:
    require_extra("e2e", "hf", "transformers")
    import torch

    impls = _check_args(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; use --device cpu")
    rec = Recorder.start(args)
    asked = [i for i in impls if i in PEER_ROWS]
    peers = from_checkout("peers", f"the rows {', '.join(asked)}") if asked else None
    peer_status = {i: peers.row_status(i, device) for i in asked}
    impls = [i for i in impls if peer_status.get(i, {"ok": True})["ok"]]
    for name, st in peer_status.items():
        print(f"peer row {name} ({st['package']} {st['version'] or '-'}): {st['status']}")
    if not impls:
        raise ValueError(f"--impls: no row can run here ({peer_status}); add a dropless row")
    shape = QUICK if args.quick else SHAPES[args.shape]
    failed: dict[str, str] = {}
    results = timing_rounds(args, impls, shape, device, failed)
    for impl, err in failed.items():
        peer_status[impl] |= {"ok": False, "status": f"failed: {err}"}
    impls = [i for i in impls if i not in failed]
    if device == "cuda":  # measured by the timing children (the last round's)
        memory = {} if args.no_memory else {i: o[-1] for i, o in results.items()}
    else:
        memory = {} if args.no_memory else memory_runs(args, impls, shape)
    rows = table_rows(results, memory, shape)
    for impl, st in peer_status.items():
        if impl in rows:
            rows[impl]["peer"] = st
    losses = [r["first_loss"] for r in rows.values()]
    # fp32: the rows differ by summation order only; bf16: by its rounding of the logits
    tol = 2e-2 if device == "cuda" else 1e-3
    if max(losses) - min(losses) > tol * max(abs(x) for x in losses):
        print(f"WARNING: first-step losses differ between implementations: {losses}")
    table = _table(rows)
    first = next(iter(results.values()))[0]
    how = "memory: separate children with mallopt" if device == "cpu" else "memory: CUDA allocator"
    figures = {
        "rounds_per_impl": {i: len(o) for i, o in results.items()},
        "shape": shape, "rounds": args.rounds, "steps": args.steps, "quick": args.quick,
        "optimizer": args.optimizer, "threads": first["threads"], "device": device,
        "checkpointing": getattr(args, "checkpointing", False),
        "fused_rmsnorm": getattr(args, "fused_rmsnorm", False),
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "allocator": f"timing: default (no malloc settings); {how}",
        "rows": rows, "peers": peer_status,
    }  # fmt: skip
    profiled = [o["profile"] for o in results.get(PROFILED, []) if "profile" in o]
    if profiled:
        figures["profile"] = {PROFILED: profiled[0]}
        prof = from_checkout("bench_profile", "--profile")
        table += "\n\n" + prof.markdown(f"`{PROFILED}` training step", profiled[0])
    print(table)
    _ratios(figures, rows)
    summary = _summary(figures)
    print(summary)
    for name, r in figures.items():
        if name.endswith("_vs_eager") or name.endswith(f"_vs_grouped_mm{SUFFIX}"):
            print(f"{name}: {r['median_paired']:.2f}x median of paired rounds "
                  f"({r['min']:.2f}-{r['max']:.2f}), {r['of_medians']:.2f}x of medians")  # fmt: skip
    record = rec.finish("e2e", figures)
    print(load_sentence(record["load"]))
    write_section(args, rec, "e2e", record, table, summary)
    return 0


def _paired(row: dict, base: dict) -> dict:
    """row / base tokens/s: the median of the per-round ratios (the rows of one round ran
    back to back) with their spread, and the ratio of the medians."""
    pairs = [a / b for a, b in zip(row.get("rounds", []), base.get("rounds", []))]
    return {
        "median_paired": statistics.median(pairs) if pairs else None,
        "min": min(pairs, default=None), "max": max(pairs, default=None), "rounds": pairs,
        "of_medians": row["tokens_per_s"] / base["tokens_per_s"],
    }  # fmt: skip


def _ratios(figures: dict, rows: dict) -> None:
    """The headline ratios against stock `grouped_mm`, added to `figures`."""
    d, g = rows.get("dropless"), rows.get("grouped_mm")
    if d and g:
        figures["speedup_vs_grouped_mm"] = d["tokens_per_s"] / g["tokens_per_s"]
        figures["best_speedup_vs_grouped_mm"] = d["best_tokens_per_s"] / g["best_tokens_per_s"]
        if d["peak_step_mib"] is not None and g["peak_step_mib"]:
            figures["memory_vs_grouped_mm"] = d["peak_step_mib"] / g["peak_step_mib"]
    for impl in COMPILED:  # a compiled row against its own eager row and stock compiled
        c, own, stock = rows.get(impl + SUFFIX), rows.get(impl), rows.get("grouped_mm" + SUFFIX)
        for name, base in ((f"{impl}{SUFFIX}_vs_eager", own),
                           (f"{impl}{SUFFIX}_vs_grouped_mm{SUFFIX}", stock)):  # fmt: skip
            if c and base and base is not c:
                figures[name] = _paired(c, base)
    fce = rows.get("dropless-fused-ce")
    if fce and g:
        figures["fused_ce_speedup_vs_grouped_mm"] = fce["tokens_per_s"] / g["tokens_per_s"]
        if fce["peak_step_mib"] is not None and g["peak_step_mib"]:
            figures["fused_ce_memory_vs_grouped_mm"] = fce["peak_step_mib"] / g["peak_step_mib"]


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
