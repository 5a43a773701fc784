"""`dropless bench e2e`: one training step (forward + backward + AdamW) of a Qwen3-MoE
model built from a config object (random weights, no download), stock Transformers v5
(`grouped_mm`, its default, and `eager`) against the same model after `dropless.patch()`.

Each row (an implementation with one AdamW setting of `--optimizer`) runs in a fresh child
process in every round, the order rotated between rounds so that load from other processes
hits the rows alike. Timing children run under the default allocator: one warm-up step
(AdamW allocates its state), then `--steps` timed steps (a round's tokens/s from their
median). Every ratio is the median of the per-round ratios against the stock row of the
same round with the same AdamW (compiled rows: stock compiled), with their min-max and the
best-of-rounds ratio beside it (common.paired). Memory is measured in separate children with glibc told to return freed memory
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
    MIN_ROUNDS,
    MIN_STEPS,
    Recorder,
    add_history_arguments,
    add_round_arguments,
    follow_live_memory,
    from_checkout,
    load_sentence,
    paired,
    peak_rss_mib,
    progress,
    require_extra,
    reset_peak_rss,
    rotated,
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
PROFILED = ("grouped_mm", "dropless")  # --profile: the rows whose steps are profiled, side by side
# AdamW settings: fused=True; neither argument (torch picks: the single-tensor loop on CPU,
# foreach on CUDA); foreach=True
OPTIMIZERS = {"fused": {"fused": True}, "default": {}, "foreach": {"foreach": True}}


def row_key(impl: str, optimizer: str) -> str:
    """A row's name: the implementation, `@optimizer` added unless AdamW is fused."""
    return impl if optimizer == "fused" else f"{impl}@{optimizer}"


def split_key(key: str) -> tuple[str, str]:
    impl, _, optimizer = key.partition("@")
    return impl, optimizer or "fused"


def add_child_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the rows' children, `bench e2e`'s and `bench lora`'s."""
    add_round_arguments(p, "timed steps per child after a warm-up step")
    p.add_argument(
        "--optimizer", default="fused,default",
        help="comma list of AdamW settings, every row once with each, its ratios against the "
        "stock row with the same: fused (fused=True: torch's fused kernel, the Trainer's "
        "default), default (torch.optim.AdamW(params) with neither argument: torch picks, on "
        "CPU the single-tensor loop, on CUDA foreach), foreach (foreach=True, the multi-tensor "
        "path: parameter-sized temporaries in the step's peak). Default: fused,default",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch threads in each child (default: torch's default, all cores)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny shape for a smoke run (not a result)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory children")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_child_arguments(p)
    p.add_argument("--eager-rounds", type=int, default=None,
                   help="rounds that include the slow stock eager row (default: all rounds)")  # fmt: skip
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
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cpu (fp32) or cuda (bf16; default: cuda when available)")  # fmt: skip
    p.add_argument(
        "--compile", action="store_true",
        help=f"add a torch.compile twin ('<row>{SUFFIX}', inductor) of the {', '.join(COMPILED)} rows",
    )  # fmt: skip
    p.add_argument("--checkpointing", action="store_true",
                   help="every row with gradient checkpointing (non-reentrant)")  # fmt: skip
    p.add_argument("--fused-rmsnorm", action="store_true",
                   help="the dropless rows with patch(fused_rmsnorm=True) too")  # fmt: skip
    p.add_argument("--profile", action="store_true", help=f"one more step of the {' and '.join(PROFILED)} "
                   "rows under torch.profiler: their per-operator tables side by side")  # fmt: skip
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
    opt = torch.optim.AdamW(params, lr=1e-4, **OPTIMIZERS[args.get("optimizer", "fused")])
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
    out = {"impl": impl, "mode": args.get("mode", "time"), "first_loss": first_loss,
           "optimizer": args.get("optimizer", "fused"), "threads": torch.get_num_threads(),
           "trainable": sum(p.numel() for p in params),
           "malloc_env": sorted(k for k in os.environ if k.startswith("MALLOC_"))}  # fmt: skip
    if out["mode"] == "memory":
        out.update(measure_memory(fwd_bwd, opt_step, tracked))
    else:
        sync = torch.cuda.synchronize if device == "cuda" else None
        times = step_times(lambda: (fwd_bwd(), opt_step()), args["steps"], sync=sync)
        out["step_s"], out["best_step_s"] = statistics.median(times), min(times)
        out["tokens_per_s"] = shape["batch"] * shape["seq"] / out["step_s"]
        if device == "cuda":
            out.update(measure_memory(fwd_bwd, opt_step, True, cuda=True))
        if args.get("profile"):
            prof = from_checkout("bench_profile", "--profile")
            out["profile"] = prof.kernel_table(lambda: (fwd_bwd(), opt_step()), device, warmup=0)
    out["dropless_calls"] = None
    if "dropless" in impl and not impl.endswith(SUFFIX):  # compiled calls: not counted
        import dropless.hf.experts as dh

        out["dropless_calls"] = sum(dh.CALLS.values())
    return out


def measure_memory(fwd_bwd, opt_step, tracked: bool | None, cuda: bool = False) -> dict:
    """Peak memory above the steady state (weights, AdamW state; no gradients) of one
    forward+backward and of one AdamW step: RSS (`follow_live_memory()` called when the
    process started) or, `cuda`, the caching allocator's counters."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        follow_live_memory()  # trims the heap again: RSS = live memory from here
        base = rss_mib()
    peaks = []
    for part in (fwd_bwd, opt_step):  # activations + gradients; gradients + AdamW's temporaries
        torch.cuda.reset_peak_memory_stats() if cuda else reset_peak_rss()
        part()
        if cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mib()
        peaks.append(peak - base)
    return {
        "peak_step_mib": max(peaks), "peak_fwd_bwd_mib": peaks[0], "peak_optimizer_mib": peaks[1],
        ("steady_mib" if cuda else "steady_rss_mib"): base, "memory_tracked": cuda or tracked,
    }  # fmt: skip


# --- the parent ---------------------------------------------------------------------------


def _check_args(args) -> list[str]:
    """-> the rows' keys: every implementation (and its compiled twin) with every AdamW
    setting of `--optimizer`."""
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    if getattr(args, "compile", False):
        impls += [i + SUFFIX for i in impls if i in COMPILED and i + SUFFIX not in impls]
    bad = [i for i in impls if i.removesuffix(SUFFIX) not in IMPLS]
    bad += [i for i in impls if i.endswith(SUFFIX) and i.removesuffix(SUFFIX) not in COMPILED]
    if bad or not impls:
        allowed = [*IMPLS, *(i + SUFFIX for i in COMPILED)]
        raise ValueError(f"--impls: unknown {bad}; allowed: {','.join(allowed)}")
    if getattr(args, "eager_rounds", None) is not None and args.eager_rounds < 1:
        raise ValueError(
            f"--eager-rounds {args.eager_rounds}: must be >= 1 (or drop eager from --impls)"
        )
    return row_keys(args, impls)


def row_keys(args, impls: list[str]) -> list[str]:
    """The rows' keys, every implementation with every AdamW setting of `--optimizer`,
    after checking `--optimizer`, `--rounds` and `--steps`."""
    opts = [s.strip() for s in args.optimizer.split(",") if s.strip()]
    if not opts or set(opts) - set(OPTIMIZERS):
        raise ValueError(f"--optimizer {args.optimizer}: a comma list from {','.join(OPTIMIZERS)}")
    if args.rounds < 1 or args.steps < 1:
        raise ValueError(
            f"--rounds and --steps must be >= 1 (>= {MIN_ROUNDS} and >= {MIN_STEPS} for a result)"
        )
    return [row_key(i, o) for o in dict.fromkeys(opts) for i in impls]


def _common(args, shape: dict, device: str, key: str) -> dict:
    """What the child of row `key` is given (`bench lora`'s LoRA rank too)."""
    impl, opt = split_key(key)
    given = ("steps", "threads", "checkpointing", "fused_rmsnorm", "rank")
    return {"shape": shape, "device": device, "impl": impl, "optimizer": opt} | {
        k: v for k, v in vars(args).items() if k in given
    }


def timing_rounds(
    args, keys, shape, device="cpu", failed=None, module="dropless.bench.e2e", rec=None
) -> dict[str, list[dict]]:
    """Timing children only (default allocator), each row in a fresh one every round, the
    order rotated; `rec` samples the machine's load between rounds. A peer row whose
    child fails is dropped, its error put in `failed`."""
    failed = {} if failed is None else failed
    results: dict[str, list[dict]] = {k: [] for k in keys}
    eager_rounds = getattr(args, "eager_rounds", None)
    # each profiled implementation's first row (its first optimizer), in round 1
    profiled = {impl: next((k for k in keys if split_key(k)[0] == impl), None) for impl in PROFILED}
    for r in range(args.rounds):
        if r and rec is not None:
            rec.sample_load()
        order = rotated(list(keys), r)
        if eager_rounds is not None and r >= eager_rounds:
            order = [k for k in order if split_key(k)[0] != "eager"]
        for key in order:
            if key in failed:
                continue
            progress(f"round {r + 1}/{args.rounds}: timing {key} (its own process)")
            profile = bool(getattr(args, "profile", False)) and key in profiled.values() and r == 0
            child = _common(args, shape, device, key)
            try:
                out = run_child(module, child | {"mode": "time", "profile": profile})
            except RuntimeError as e:
                if child["impl"] not in PEER_ROWS:
                    raise
                # a peer that breaks on this stack costs its own row, not the table
                failed[key] = str(e).strip().splitlines()[-1][:300]
                print(f"round {r + 1}/{args.rounds} {key}: failed ({failed[key]})", flush=True)
                continue
            results[key].append(out | {"round": r})
            print(f"round {r + 1}/{args.rounds} {key:22s} {out['tokens_per_s']:8.0f} tokens/s "
                  f"step {out['step_s']:.2f} s  loss {out['first_loss']:.4f}", flush=True)  # fmt: skip
    return {k: outs for k, outs in results.items() if k not in failed}


def memory_runs(args, keys, shape, module="dropless.bench.e2e") -> dict[str, dict]:
    """One memory child per row (mallopt inside it), separate from timing."""
    out = {}
    for key in keys:
        progress(f"memory: measuring {key} (its own process)")
        child = _common(args, shape, "cpu", key) | {"mode": "memory", "steps": 0}
        out[key] = run_child(module, child)
        print(f"memory {key:22s} peak step {out[key]['peak_step_mib']:.0f} MiB", flush=True)
    return out


def table_rows(results: dict, memory: dict, shape: dict) -> dict:
    """Each row's speed over its rounds (each a timing child's result): median tokens/s
    and step time, tokens/s of the best step, the first loss, every round's tokens/s (and
    which round it was); and its memory (`memory`: the memory child's, or on CUDA the
    timing child's)."""
    rows = {}
    for key, outs in results.items():
        impl, opt = split_key(key)
        rows[key] = {
            "impl": impl, "optimizer": opt,
            "tokens_per_s": statistics.median(o["tokens_per_s"] for o in outs),
            "step_s": statistics.median(o["step_s"] for o in outs),
            "best_tokens_per_s": shape["batch"] * shape["seq"] / min(o["best_step_s"] for o in outs),
            "first_loss": outs[0]["first_loss"], "trainable": outs[0].get("trainable"),
            "rounds": [o["tokens_per_s"] for o in outs],
            "round_ids": [o.get("round", i) for i, o in enumerate(outs)],
        }  # fmt: skip
        for k in ("peak_step_mib", "peak_fwd_bwd_mib", "peak_optimizer_mib", "memory_tracked"):
            rows[key][k] = memory.get(key, {}).get(k)
    return rows


def ratios_vs(rows: dict, base_impl: str) -> None:
    """Each row against `base_impl` with the same AdamW (a compiled row: its compiled twin):
    sets its `vs_BASE` (common.paired over the rounds) and `memory_vs_BASE` (a plain ratio)."""
    for key, r in rows.items():
        impl, opt = split_key(key)
        base = row_key(base_impl + (SUFFIX if impl.endswith(SUFFIX) else ""), opt)
        if base not in rows:
            continue
        b = rows[base]
        r[f"vs_{base_impl}"] = _paired(r, b)
        mem = r.get("peak_step_mib") is not None and b.get("peak_step_mib")
        r[f"memory_vs_{base_impl}"] = r["peak_step_mib"] / b["peak_step_mib"] if mem else None


def _paired(row: dict, base: dict) -> dict | None:
    return paired(*(dict(zip(x["round_ids"], x["rounds"])) for x in (row, base)))


def _ratios(figures: dict, rows: dict) -> None:
    """Every row's ratios against stock `grouped_mm` (`ratios_vs`); a compiled row's
    against its own eager row too; the headline figures (AdamW fused) added to `figures`."""
    ratios_vs(rows, "grouped_mm")
    for key, r in rows.items():
        impl, opt = split_key(key)
        own = row_key(impl.removesuffix(SUFFIX), opt)
        if impl.endswith(SUFFIX) and own in rows:
            figures[f"{key}_vs_eager"] = _paired(r, rows[own])
            if impl != "grouped_mm" + SUFFIX and r.get("vs_grouped_mm"):
                figures[f"{key}_vs_grouped_mm{SUFFIX}"] = r["vs_grouped_mm"]
    for name, key in (("", "dropless"), ("fused_ce_", "dropless-fused-ce")):
        vs = rows.get(key, {}).get("vs_grouped_mm")
        if vs:
            figures[f"{name}speedup_vs_grouped_mm"] = vs["median"]
            figures[f"best_{name}speedup_vs_grouped_mm"] = vs["best"]
            if rows[key].get("memory_vs_grouped_mm") is not None:
                figures[f"{name}memory_vs_grouped_mm"] = rows[key]["memory_vs_grouped_mm"]


def run(args) -> int:
    require_extra("e2e", "hf", "transformers")
    import torch

    keys = _check_args(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; use --device cpu")
    rec = Recorder.start(args)
    asked = list(dict.fromkeys(split_key(k)[0] for k in keys if split_key(k)[0] in PEER_ROWS))
    peers = from_checkout("peers", f"the rows {', '.join(asked)}") if asked else None
    peer_status = {i: peers.row_status(i, device) for i in asked}
    keys = [k for k in keys if peer_status.get(split_key(k)[0], {"ok": True})["ok"]]
    for name, st in peer_status.items():
        print(f"peer row {name} ({st['package']} {st['version'] or '-'}): {st['status']}")
    if not keys:
        raise ValueError(f"--impls: no row can run here ({peer_status}); add a dropless row")
    shape = QUICK if args.quick else SHAPES[args.shape]
    failed: dict[str, str] = {}
    results = timing_rounds(args, keys, shape, device, failed, rec=rec)
    for key, err in failed.items():
        peer_status[split_key(key)[0]] |= {"ok": False, "status": f"failed: {err}"}
    keys = [k for k in keys if k not in failed]
    if device == "cuda":  # measured by the timing children (the last round's)
        memory = {} if args.no_memory else {k: o[-1] for k, o in results.items()}
    else:
        memory = {} if args.no_memory else memory_runs(args, keys, shape)
    rows = table_rows(results, memory, shape)
    for r in rows.values():
        if r["impl"] in peer_status:
            r["peer"] = peer_status[r["impl"]]
    losses = [r["first_loss"] for r in rows.values()]
    # fp32: the rows differ by summation order only; bf16: by its rounding of the logits
    tol = 2e-2 if device == "cuda" else 1e-3
    if max(losses) - min(losses) > tol * max(abs(x) for x in losses):
        print(f"WARNING: first-step losses differ between implementations: {losses}")
    how = "memory: separate children with mallopt" if device == "cpu" else "memory: CUDA allocator"
    figures = {
        "rounds_per_impl": {k: len(o) for k, o in results.items()},
        "shape": shape, "rounds": args.rounds, "steps": args.steps, "quick": args.quick,
        "optimizer": ",".join(dict.fromkeys(split_key(k)[1] for k in keys)),
        "threads": next(iter(results.values()))[0]["threads"], "device": device,
        "checkpointing": getattr(args, "checkpointing", False),
        "fused_rmsnorm": getattr(args, "fused_rmsnorm", False),
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "allocator": f"timing: default (no malloc settings); {how}",
        "rows": rows, "peers": peer_status,
    }  # fmt: skip
    _ratios(figures, rows)
    table = _table(rows)
    profiled = {split_key(k)[0]: o["profile"] for k, outs in results.items() for o in outs
                if "profile" in o}  # fmt: skip
    if profiled:
        figures["profile"] = profiled
        prof = from_checkout("bench_profile", "--profile")
        table += "\n\n" + prof.side_by_side("training step", profiled)
    print(table)
    summary = finish_summary(args, rec, figures, _summary(rows, figures))
    record = rec.finish("e2e", figures)
    print(load_sentence(record["load"]))
    write_section(args, rec, "e2e", record, table, summary)
    return 0


def finish_summary(args, rec, figures: dict, summary: str) -> str:
    """The summary with the run's verdict (common.verdict, from the load sampled now, at
    the end of the measuring) under it, printed; the verdict goes into `figures`."""
    figures["verdict"] = rec.verdict(args.steps, args.rounds, args.quick)
    summary = "  \n".join(s for s in (summary, figures["verdict"]) if s)
    print(summary)
    return summary


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
