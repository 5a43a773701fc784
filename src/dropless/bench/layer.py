"""`dropless bench layer`: one MoE layer forward+backward against the dense-GEMM bound,
Hugging Face v5 `Qwen3MoeSparseMoeBlock` and the peers.

Every row gets the same input, weights and routing (checked equal). Each row runs in a
fresh child process in every round (`--warmup` untimed steps, then `--steps` timed ones: the
round's time is their median), the order rotated between rounds; a row's ms is the median
over rounds, its ratios (vs the dense bound, vs HF grouped_mm) the median of the per-round
ratios with their min-max and best-of-rounds (common.paired). Memory: one more step, before
the warm-up, in the first round's child (CPU: VmHWM minus RSS after allocation; CUDA:
max_memory_allocated minus memory_allocated). The dense bound (bench/bound.py) is the six
expert GEMMs as dense `torch.mm` on preallocated operands, 18*T*K*D*F FLOPs: every row's
TFLOP/s and share of the bound use those FLOPs. The experts-path variants and peer rows
run from a checkout (tools/layer_paths.py, tools/peers.py).
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, M = T*K rows

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial

import torch

from ..ops.expert_mlp import plan as gemm_tuning
from .bound import BOUND_GEMMS, dense_bound, layer_flops, machine_rates
from .common import (
    MIN_ROUNDS,
    MIN_STEPS,
    Recorder,
    add_history_arguments,
    add_round_arguments,
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
    write_section,
)
from .layer_table import notes as _notes
from .layer_table import table as _table

SHAPES = {
    "qwen3": dict(E=64, K=8, D=1024, F=384, T=[2048], dtype="float32"),
    "mixtral": dict(E=8, K=2, D=1024, F=3584, T=[2048], dtype="float32"),
    "qwen3-30b": dict(E=128, K=8, D=2048, F=768, T=[8192, 32768], dtype="bfloat16"),
    "tiny": dict(E=6, K=2, D=64, F=32, T=[48], dtype="float32"),  # a smoke shape, not a result
}
# `--impls all`: the rows of the CPU tables
IMPLS = ("dense", "dropless", "dropless-grouped", "composed", "bmm-padded", "hf-grouped_mm",
         "hf-eager")  # fmt: skip
# rows asked for by name, the GPU tables' (`scripts/gpu_check.py`), peers included; the
# `dropless.MoE` rows under a recipe or with the eager row ops (tools/layer_paths.VARIANTS)
VARIANTS = ("dropless-fp8-current-row", "dropless-fp8-delayed", "dropless-mxfp8-saved",
            "dropless-eager-row-ops")  # fmt: skip
PEER_ROWS = ("liger-moe", "torchao-fp8-row")  # tools/peers.py's LAYER_ROWS
EXTRA_IMPLS = ("grouped_mm-plain", *VARIANTS, *PEER_ROWS)
# the rows run from a checkout: tools/ module -> rows
CHECKOUT_ROWS = {"layer_paths": ("composed", "grouped_mm-plain", "bmm-padded", *VARIANTS),
                 "peers": PEER_ROWS}  # fmt: skip
QUANTIZED = (*VARIANTS[:3], "torchao-fp8-row")  # rows whose output differs by FP8 rounding
PROFILED = ("dropless", "dropless-fp8-current-row")  # --profile: one bf16, one FP8 step
BOUND = {
    "gemms": [f"{what}: {shapes}" for what, shapes in BOUND_GEMMS],
    "flops": "18*T*K*D*F",
    "excludes": "routing, gather, SwiGLU, combine, autograd; operands allocated before timing",
}
DEFAULT_IMPLS = ("dense", "dropless", "hf-grouped_mm", "hf-eager")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen3", help="layer shape (default qwen3)"
    )
    p.add_argument("--tokens", type=int, nargs="+", help="T, overrides the shape's token counts")
    add_round_arguments(p)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per child first")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma list from "
                   f"{','.join(IMPLS + EXTRA_IMPLS)} or 'all' (= {','.join(IMPLS)}; default: "
                   f"{','.join(DEFAULT_IMPLS)})")  # fmt: skip
    p.add_argument("--no-skewed", action="store_true", help="skip the skewed-routing rows")
    p.add_argument("--no-memory", action="store_true", help="skip the memory step")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--busy-core", type=int, nargs="?", const=-1, default=None, metavar="CORE",
        help="run a busy process pinned to CORE (no value: the last core this process may use) "
        "for the whole run, to see the layer under contention; said in the table and history",
    )  # fmt: skip
    p.add_argument(
        "--profile", action="store_true",
        help=f"after timing, one step each of {' and '.join(PROFILED)} under torch.profiler: "
        "a per-kernel table (name, calls, total ms, share) in the record and the table",
    )  # fmt: skip
    add_history_arguments(p, "layer")


# --- building the implementations ------------------------------------------------------


_SETUP_KEYS = ("E", "K", "D", "F", "T", "dtype", "device", "skewed")
_SETUP_CACHE: dict[tuple, tuple] = {}  # the last case's tensors: generated once per case


def _setup(cfg: dict):
    """Inputs, router weight and expert weights shared by every implementation: copies
    of one generation per case (at the GPU shape generating them on the CPU takes
    seconds, and every row and every output check builds its own set)."""
    key = tuple(cfg[k] for k in _SETUP_KEYS)
    if key not in _SETUP_CACHE:
        _SETUP_CACHE.clear()
        _SETUP_CACHE[key] = _generate(cfg)
    return tuple(t.clone() for t in _SETUP_CACHE[key])


def _generate(cfg: dict):
    E, K, D, F, T = cfg["E"], cfg["K"], cfg["D"], cfg["F"], cfg["T"]
    dev, dtype = torch.device(cfg["device"]), getattr(torch, cfg["dtype"])
    g = torch.Generator().manual_seed(0)
    x_TD = torch.randn(T, D, generator=g)
    w_router_ED = torch.randn(E, D, generator=g) * D**-0.5
    if cfg["skewed"]:
        # the router bias, carried by a constant input feature: the 4 "hot" experts get
        # +b on every token's logit, b chosen so that about half the pairs go to them
        x_TD[:, 0] = 1.0
        w_router_ED[:, 0] = 0.0
        w_router_ED[:4, 0] = _skew_bias(x_TD, w_router_ED, K)
    gate_up = torch.randn(E, 2 * F, D, generator=g) * D**-0.5
    down = torch.randn(E, D, F, generator=g) * F**-0.5
    grad_TD = torch.randn(T, D, generator=g)
    to = dict(device=dev, dtype=dtype)
    return x_TD.to(**to), w_router_ED.to(**to), gate_up.to(**to), down.to(**to), grad_TD.to(**to)


def _skew_bias(x_TD, w_ED, K) -> float:
    """The logit bias of the 4 hot experts that sends about half the pairs to them."""
    lo, hi = 0.0, 50.0
    for _ in range(30):
        mid = (lo + hi) / 2
        w = w_ED.clone()
        w[:4, 0] = mid
        hot = float(((x_TD @ w.t()).topk(K, dim=-1).indices < 4).float().mean())
        lo, hi = (mid, hi) if hot < 0.5 else (lo, mid)
    return hi


def build_impl(name: str, cfg: dict):
    """-> (step, params, forward): step() runs forward+backward once."""
    x_TD, w_router, gate_up, down, grad_TD = _setup(cfg)
    x_TD.requires_grad_(name != "dense")
    if name == "dense":
        return dense_bound(x_TD, gate_up, down, grad_TD, cfg["K"]), [], None
    if name.startswith("hf-"):
        block = hf_block(cfg, name[3:], w_router, gate_up, down)

        def step():
            block(x_TD.unsqueeze(0)).backward(grad_TD.unsqueeze(0))

        return step, list(block.parameters()) + [x_TD], lambda: block(x_TD.unsqueeze(0))[0]
    if name in ("dropless", "dropless-grouped", *VARIANTS):
        return _dropless(name, cfg, x_TD, w_router, gate_up, down, grad_TD)
    # experts-path variants and peers with the router of `route` (identical routing)
    paths = from_checkout("layer_paths", f"the row {name}")
    path = {**paths.EXPERT_PATHS, **from_checkout("peers", f"the row {name}").LAYER_PATHS}[name]
    leaves = [t.requires_grad_(True) for t in (w_router, gate_up, down)]

    def forward():
        ids_TK, w_TK = paths.route(x_TD, w_router, cfg["K"])
        return path(x_TD, ids_TK, w_TK, gate_up, down)

    def step():
        forward().backward(grad_TD)

    return step, [*leaves, x_TD], forward


def _dropless(name, cfg, x_TD, w_router, gate_up, down, grad_TD):
    """`dropless.MoE` with the shared weights; a variant runs in its context (a recipe's
    autocast, the eager row ops: tools/layer_paths.py)."""
    from dropless import nn as dnn

    context = contextlib.nullcontext
    if name in VARIANTS:
        context = partial(from_checkout("layer_paths", f"the row {name}").variant_context, name)

    E, K, D, F = cfg["E"], cfg["K"], cfg["D"], cfg["F"]
    backend = "grouped_mm" if name == "dropless-grouped" else None
    moe = dnn.MoE(
        D, F, E, K, renormalize=True, backend=backend, device=x_TD.device, dtype=x_TD.dtype
    )
    with torch.no_grad():
        moe.router.weight.copy_(w_router)
        moe.experts.gate_up_proj.copy_(gate_up)
        moe.experts.down_proj.copy_(down)

    def step():
        with context():
            moe(x_TD)[0].backward(grad_TD)

    def forward():
        with context():
            return moe(x_TD)[0]

    return step, list(moe.parameters()) + [x_TD], forward


def hf_block(cfg, impl, w_router, gate_up, down):
    """Hugging Face v5's `Qwen3MoeSparseMoeBlock` with the shared weights (the hf-* rows)."""
    require_extra("layer", "hf", "transformers")  # the command line says it in one line
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    conf = Qwen3MoeConfig(
        hidden_size=cfg["D"], moe_intermediate_size=cfg["F"], num_experts=cfg["E"],
        num_experts_per_tok=cfg["K"], norm_topk_prob=True, experts_implementation=impl,
    )  # fmt: skip
    with torch.device(w_router.device):  # its own initialization on the device: fast on a GPU
        block = Qwen3MoeSparseMoeBlock(conf).to(dtype=w_router.dtype)
    assert block.experts.config._experts_implementation == impl
    with torch.no_grad():
        block.gate.weight.copy_(w_router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    return block


# --- measuring ---------------------------------------------------------------------------


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _zero(params):
    for p in params:
        p.grad = None


def _time_once(step, params, dev) -> float:
    _zero(params)
    _sync(dev)
    t0 = time.perf_counter()
    step()
    _sync(dev)
    return (time.perf_counter() - t0) * 1e3


def _child(cfg: dict) -> dict:
    """One row in a fresh process: `warmup` + `steps` steps -> ms (median), ms_all, memory."""
    torch.set_num_threads(cfg["threads"])
    dev = torch.device(cfg["device"])
    step, params, _ = build_impl(cfg["impl"], cfg)
    gc.collect()
    # memory: CPU, a fresh process's first step; CUDA after timing (not the libraries' buffers)
    memory, cuda = cfg.get("memory"), dev.type == "cuda"
    out = _peak(step, params, dev) if memory and not cuda else {"peak_mib": None, "how": "skipped"}
    for _ in range(cfg["warmup"]):
        _time_once(step, params, dev)
    times = [_time_once(step, params, dev) for _ in range(cfg["steps"])]
    out = _peak(step, params, dev) if memory and cuda else out
    return out | {"ms": statistics.median(times), "ms_all": times}


def _peak(step, params, dev) -> dict:
    """One step's peak memory above what is allocated before it, no gradients held (as
    after zero_grad(set_to_none=True)): on CUDA the caching allocator's counters (exact:
    it counts every tensor), on CPU VmHWM (reset through clear_refs) minus VmRSS."""
    _zero(params)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    elif not reset_peak_rss():
        return {"peak_mib": None, "how": "VmHWM reset unavailable"}
    else:
        base = rss_mib()
    step()
    _sync(dev)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mib()
    _zero(params)
    how = "cuda max_memory_allocated minus" if cuda else "VmHWM after clear_refs, minus VmRSS"
    return {"peak_mib": peak - base, "how": f"{how} before the step"}


def _check_same(cfg, impls) -> dict:
    """Max relative difference of each output from the first non-dense one (sanity)."""
    outs = {}
    for name in impls:
        if name == "dense":
            continue
        _, _, fwd = build_impl(name, cfg)
        with torch.no_grad():
            outs[name] = fwd().float()
    ref = next(iter(outs.values()), None)
    return {k: float((v - ref).abs().max() / ref.abs().max()) for k, v in outs.items()}


def _time_impls(cfg: dict, impls, args, rec=None) -> tuple[dict, dict]:
    """-> ({impl: {round: ms}}, {impl: memory}): every row in a fresh child each round, the
    order rotated, the memory step in round 1's; `rec` samples the load between rounds."""
    label = f"T={cfg['T']} {'skewed' if cfg['skewed'] else 'uniform'}"
    times: dict[str, dict[int, float]] = {name: {} for name in impls}
    memory: dict[str, dict] = {}
    for r in range(args.rounds):
        if r and rec is not None:
            rec.sample_load()
        for name in rotated(list(impls), r):
            progress(f"{label} round {r + 1}/{args.rounds}: timing {name} (its own process)")
            child = cfg | {"impl": name, "warmup": args.warmup, "steps": args.steps,
                           "memory": r == 0 and not args.no_memory}  # fmt: skip
            out = run_child("dropless.bench.layer", child)
            times[name][r] = out["ms"]
            if r == 0:
                memory[name] = {k: out[k] for k in ("peak_mib", "how")}
    return times, memory


def _run_case(cfg: dict, impls, args, rec=None) -> list[dict]:
    times, memory = _time_impls(cfg, impls, args, rec)
    diffs = _check_same(cfg, impls)
    _SETUP_CACHE.clear()
    flops = layer_flops(cfg["T"], cfg["K"], cfg["D"], cfg["F"])
    speed = {n: {r: 1 / ms for r, ms in v.items()} for n, v in times.items()}
    rate = cfg.get("matmul_tflops")  # the machine's dense matmul rate in the shape's dtype
    rows = []
    for name in impls:
        ms = statistics.median(times[name].values())
        gflops = flops / ms / 1e6
        tflops = gflops / 1e3  # from gflops: the record's two rates agree to the last bit
        vs = {b: paired(speed[name], speed[b]) for b in ("dense", "hf-grouped_mm") if b in speed}
        share = vs["dense"]["median"] if "dense" in vs else None
        rows.append(
            {
                "impl": name, "T": cfg["T"], "routing": "skewed" if cfg["skewed"] else "uniform",
                "ms": ms, "ms_all": list(times[name].values()), "steps": args.steps,
                "gflops": gflops, "tflops": tflops,
                "vs_bound": share, "share_of_bound": share,
                "share_of_matmul_rate": tflops / rate if rate else None,
                "vs_hf_grouped_mm": vs["hf-grouped_mm"]["median"] if "hf-grouped_mm" in vs else None,
                "paired": vs,
                "peak_mib": memory[name]["peak_mib"], "memory_how": memory[name]["how"],
                "max_rel_diff": diffs.get(name),
            }
        )  # fmt: skip
    hf_mem = next((r["peak_mib"] for r in rows if r["impl"] == "hf-grouped_mm"), None)
    for r in rows:
        r["mem_vs_hf"] = r["peak_mib"] / hf_mem if hf_mem and r["peak_mib"] is not None else None
    return rows


def _check_args(args, dev: str) -> list[str]:
    shape = SHAPES[args.shape]
    if shape["dtype"] == "bfloat16" and dev == "cpu":
        raise ValueError(
            f"--shape {args.shape} is bf16 and meant for a GPU (bf16 matmul on CPU is ~80x "
            "slower than fp32); pick --shape qwen3 or mixtral on CPU"
        )
    if min(args.rounds, args.steps) < 1 or args.warmup < 0:
        raise ValueError(
            f"--rounds {args.rounds} --steps {args.steps} --warmup {args.warmup}: rounds and "
            f"steps must be >= 1 (>= {MIN_ROUNDS} and >= {MIN_STEPS} for a result)"
        )
    impls = IMPLS if args.impls == "all" else [s.strip() for s in args.impls.split(",")]
    bad = [n for n in impls if n not in IMPLS + EXTRA_IMPLS]
    if bad:
        raise ValueError(
            f"--impls: unknown {bad}; allowed: {', '.join(IMPLS + EXTRA_IMPLS)} or all"
        )
    for module, rows in CHECKOUT_ROWS.items():
        if any(n in rows for n in impls):
            from_checkout(module, f"the rows {', '.join(n for n in impls if n in rows)}")
    return list(impls)


def start_busy_core(core: int) -> tuple[subprocess.Popen, int]:
    """A Python process spinning on one core (pinned with sched_setaffinity) -> (proc, core).
    core -1: the last core this process may run on."""
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1] if core == -1 else core
    if core not in allowed:
        raise ValueError(f"--busy-core {core}: not a core this process may use ({allowed})")
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(proc.pid, {core})
    return proc, core


def run(args) -> int:
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    impls = _check_args(args, dev)
    rec = Recorder.start(args)
    busy, core = start_busy_core(args.busy_core) if args.busy_core is not None else (None, None)
    try:
        all_rows, table, extra = _measure(args, dev, impls, core, rec)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    dims = {k: v for k, v in SHAPES[args.shape].items() if k != "T"}
    figures = {
        "shape": args.shape, "dims": dims, "rows": all_rows, "threads": torch.get_num_threads(),
        "busy_core": core, "rounds": args.rounds, "steps": args.steps, **extra,
    }  # fmt: skip
    # the verdict from the load sampled now; a spinner of --busy-core is this run's own
    figures["verdict"] = rec.verdict(args.steps, args.rounds, args.shape == "tiny")
    print(figures["verdict"])
    record = rec.finish("layer", figures)
    print(load_sentence(record["load"]))
    write_section(args, rec, "layer", record, table + f"\n{figures['verdict']}\n")
    return 0


def _measure(args, dev: str, impls: list[str], busy_core: int | None, rec=None):
    """-> (rows, markdown, {matmul, bound, peers[, profile]}): the peer rows that cannot
    run here are left out of the timing and named in `peers`."""
    shape = SHAPES[args.shape]
    torch.set_num_threads(os.cpu_count())
    asked = [n for n in impls if n in PEER_ROWS]
    peers = from_checkout("peers", f"the rows {', '.join(asked)}") if asked else None
    peer_status = {n: peers.row_status(n, dev) for n in asked}
    base = {k: v for k, v in shape.items() if k != "T"} | {"device": dev, "skewed": False}
    base["threads"] = torch.get_num_threads()
    T0 = (args.tokens or shape["T"])[0]
    for name, st in peer_status.items():
        if st["ok"]:  # one step first: a peer that breaks here costs its row, not the table
            err = _probe(name, base | {"T": T0})
            if err:
                peer_status[name] = st | {"ok": False, "status": f"failed: {err}"}
    impls = [n for n in impls if peer_status.get(n, {"ok": True})["ok"]]
    progress("measuring the dense matmul rate")
    rates = machine_rates(dev, shape["dtype"])
    all_rows, text = [], []
    for T in args.tokens or shape["T"]:
        cfg = base | {"T": T}
        cfg["matmul_tflops"] = rates[shape["dtype"]]["tflops"]
        rows = _run_case(cfg, impls, args, rec)
        if not args.no_skewed:
            sk = [n for n in impls if n in ("dense", "dropless", "hf-grouped_mm")]
            rows += _run_case({**cfg, "skewed": True}, sk, args, rec)
        for r in rows:
            if r["impl"] in peer_status:
                r["peer"] = peer_status[r["impl"]]
        all_rows += rows
        text.append(_table(rows, args.shape, cfg, busy_core))
    text.append(_notes(rates, peer_status))
    extra = {"matmul": rates, "bound": BOUND, "peers": peer_status}
    if args.profile:
        prof = from_checkout("bench_profile", "--profile")
        extra["profile"], tables = prof.layer_steps(build_impl, cfg | {"T": T0}, PROFILED)
        text += tables
        _SETUP_CACHE.clear()
    # which implementation ran each expert GEMM (planned again by the output check here)
    text.append(gemm_tuning.choices_note())
    table = "\n".join(text)
    print(table)
    for r in all_rows:  # a recipe's rows differ by its quantization noise
        if r["impl"] not in QUANTIZED and (r["max_rel_diff"] or 0) > 1e-3:
            print(f"warning: {r['impl']} output differs by {r['max_rel_diff']:.2e} (relative)")
    return all_rows, table, extra


def _probe(name: str, cfg: dict) -> str | None:
    """One step of a row: None if it ran, else its error in one line."""
    progress(f"T={cfg['T']} {name}: one step before timing")
    try:
        step, params, _ = build_impl(name, cfg)
        _time_once(step, params, torch.device(cfg["device"]))
    except Exception as e:  # noqa: BLE001 - whatever a peer raises, the other rows run
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]
    finally:
        _SETUP_CACHE.clear()
    return None


if __name__ == "__main__":  # a row's child: python -m dropless.bench.layer '{json}'
    print(json.dumps(_child(json.loads(sys.argv[1]))))
