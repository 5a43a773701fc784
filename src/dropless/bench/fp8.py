"""`dropless bench fp8`: activation memory of a MoE layer with FP8 / MXFP8 saved
activations vs bf16, and (on a GPU) step time of bf16 vs FP8 / MXFP8.

Memory is the bytes of the tensors autograd keeps from forward to backward, counted
with `torch.autograd.graph.saved_tensors_hooks` (each storage once; parameters and
views of them excluded): exact, and independent of the allocator, so it is measured
on CPU. Step times need a GPU (bf16 matmul on these CPUs runs ~80x slower than fp32)
and are reported only when one is present.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .common import (
    Recorder,
    add_history_arguments,
    add_section_argument,
    require_default_allocator,
    step_times,
    write_section,
)

# the Qwen3-30B-A3B layer scaled down (docs/design.md, "The reference shape")
SHAPE = dict(T=512, D=1024, F=384, E=64, K=8)
VARIANTS = ("bf16", "fp8_current", "fp8_delayed", "mxfp8")


def saved_tensor_bytes(fn, exclude: list[torch.Tensor] = ()) -> tuple[int, object]:
    """Run fn() and count the bytes of the tensors it saves for backward.

    Each storage counts once (a view shares its base's bytes); storages of the
    `exclude` tensors (the parameters) are left out. Returns (bytes, fn's result).
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip and st.nbytes():
            seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _recipe(name: str, saved: bool):
    from dropless import quant

    if name == "fp8_current":
        return quant.Float8CurrentScaling(fp8_saved_activations=saved)
    if name == "fp8_delayed":
        return quant.DelayedScaling(fp8_saved_activations=saved)
    if name == "mxfp8":
        return quant.MXFP8BlockScaling(fp8_saved_activations=saved)
    return None


def _token_path_forward(moe, x_TD, recipe):
    """The MoE layer's forward with the expert MLP handed x_TD and the token indices
    (what `ops.expert_mlp` does at full precision), for recipes: only x_TD, which the
    router keeps anyway, is saved for the experts' input."""
    from dropless.ops import load_balancing_loss_global, sort_by_expert, z_loss
    from dropless.quant import quantized_grouped_mlp

    r = moe.router(x_TD)
    sp = sort_by_expert(r.ids_TK, moe.num_experts)
    prob_S = r.weights_TK.to(x_TD.dtype).reshape(-1).index_select(0, sp.pair_S)
    ex = moe.experts
    out = quantized_grouped_mlp(
        x_TD,
        sp.counts,
        prob_S,
        ex.gate_up_proj,
        ex.down_proj,
        recipe=recipe,
        token_S=sp.token_S,
        slot_TK=sp.slot_TK,
        num_out=x_TD.shape[0],
    )
    lb = load_balancing_loss_global(r.scores_TE, sp.counts_E, x_TD.shape[0])
    return out, lb + z_loss(r.logits_TE)


def measure_memory(
    shape: dict, variant: str, path: str = "moe", seed: int = 0, backward: bool = True
) -> dict:
    """Saved-activation bytes of one MoE layer forward (bf16 weights and input).

    path "moe": `dropless.MoE.forward` as wired now; "tokens": the expert MLP given
    x_TD and token indices (see `_token_path_forward`)."""
    import dropless

    torch.manual_seed(seed)
    moe = dropless.MoE(shape["D"], shape["F"], shape["E"], shape["K"], dtype=torch.bfloat16)
    x = torch.randn(shape["T"], shape["D"], dtype=torch.bfloat16, requires_grad=True)
    recipe = _recipe(variant, saved=True)

    def fwd():
        with dropless.autocast(enabled=recipe is not None, recipe=recipe):
            if path == "tokens" and recipe is not None:
                out, aux = _token_path_forward(moe, x, recipe)
                return out.float().sum() + aux  # a linear loss: keeps nothing itself
            out, aux = moe(x)
            return out.float().sum() + aux.lb_loss + aux.z_loss

    t0 = time.perf_counter()
    nbytes, loss = saved_tensor_bytes(fwd, exclude=list(moe.parameters()))
    if backward:
        loss.backward()
        assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    return {
        "saved_MiB": nbytes / 2**20,
        "bytes_per_token": nbytes / shape["T"],
        "seconds": time.perf_counter() - t0,
    }


def measure_step_time(shape: dict, variant: str, steps: int) -> float:
    """Median ms of a MoE layer forward+backward on CUDA (bf16 weights)."""
    import dropless

    torch.manual_seed(0)
    moe = dropless.MoE(
        shape["D"], shape["F"], shape["E"], shape["K"], dtype=torch.bfloat16, device="cuda"
    )
    x = torch.randn(shape["T"], shape["D"], dtype=torch.bfloat16, device="cuda", requires_grad=True)
    recipe = _recipe(variant, saved=True)

    def step():
        with dropless.autocast(enabled=recipe is not None, recipe=recipe):
            out, _ = moe(x)
        out.float().sum().backward()

    return 1e3 * statistics.median(step_times(step, steps, 2, torch.cuda.synchronize))


def add_arguments(p: argparse.ArgumentParser) -> None:
    for k, v in SHAPE.items():
        p.add_argument(f"--{k}", type=int, default=v, help=f"{k} (default {v})")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument(
        "--no-backward",
        action="store_true",
        help="skip the backward (memory is counted in forward)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant on a GPU")
    add_history_arguments(p)
    add_section_argument(p, "fp8")


def run(args) -> int:
    shape = {k: getattr(args, k) for k in SHAPE}
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "bf16" not in variants:
        print(
            f"error: --variants must include bf16 and use only {VARIANTS}; got {variants}",
            file=sys.stderr,
        )
        return 2
    if torch.cuda.is_available():
        require_default_allocator("fp8")  # step times are taken in this process
    rec = Recorder.start(args)
    shape_s = ", ".join(f"{k}={v}" for k, v in shape.items())
    print(f"MoE layer {shape_s}; saved activations counted with saved_tensors_hooks (CPU)")
    figures: dict = {"shape": shape, "memory": {}}
    for v in variants:
        for path in ("moe", "tokens") if v != "bf16" else ("moe",):
            key = v if path == "moe" else f"{v}, x_TD path"
            figures["memory"][key] = measure_memory(shape, v, path, backward=not args.no_backward)
    base = figures["memory"]["bf16"]["saved_MiB"]
    for m in figures["memory"].values():
        m["ratio_vs_bf16"] = m["saved_MiB"] / base
    if torch.cuda.is_available():
        from dropless.quant import torch_fp8_available

        figures["gpu"] = torch.cuda.get_device_name()
        figures["step_ms"] = {}
        for v in variants:
            if v != "bf16" and v != "mxfp8" and not torch_fp8_available():
                continue
            figures["step_ms"][v] = measure_step_time(shape, v, args.steps)
    record = rec.finish("fp8", figures)
    text = render(figures)
    print(text)
    write_section(args, rec, "fp8", record, text)
    return 0


def render(f: dict) -> str:
    """The tables of one `dropless bench fp8` run (its section's body)."""
    lines = [
        "| saved activations | MiB | bytes/token | vs bf16 | s (fwd+bwd) |",
        "|---|---|---|---|---|",
    ]
    for v, m in f["memory"].items():
        lines.append(
            f"| {v} | {m['saved_MiB']:.2f} | {m['bytes_per_token']:.0f} "
            f"| {m['ratio_vs_bf16']:.3f} | {m['seconds']:.1f} |"
        )
    lines.append("")
    if f.get("step_ms"):
        lines.append(f"Step time on {f['gpu']} (median of the timed steps, ms):")
        lines.append("")
        lines += ["| variant | ms |", "|---|---|"]
        lines += [f"| {v} | {ms:.2f} |" for v, ms in f["step_ms"].items()]
    else:
        lines.append("Step time (bf16 vs FP8 vs MXFP8): no GPU in this run, unverified.")
    return "\n".join(lines) + "\n"
