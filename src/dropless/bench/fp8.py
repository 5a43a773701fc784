"""`dropless bench fp8`: saved-activation memory of a MoE layer with FP8 / MXFP8 saved
activations vs bf16, and on a GPU the step time of each. Memory is the bytes of the tensors
autograd keeps for backward (`saved_tensors_hooks`, each storage once, parameters
excluded): exact and allocator-independent, so it is measured on CPU.
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
    require_default_allocator,
    step_times,
    write_section,
)

# the Qwen3-30B-A3B layer scaled down (docs/design.md, "The reference shape")
SHAPE = dict(T=512, D=1024, F=384, E=64, K=8)
# variant -> its recipe (`quant.recipe_from_name`), with FP8 saved activations
RECIPES = {"bf16": "none", "fp8_current": "current", "fp8_delayed": "delayed", "mxfp8": "mxfp8"}
VARIANTS = tuple(RECIPES)


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


def _layer(shape: dict, variant: str, device: str = "cpu"):
    """(a bf16 `dropless.MoE` layer, its input, the variant's recipe), from seed 0."""
    import dropless
    from dropless.quant import recipe_from_name

    torch.manual_seed(0)
    kw = dict(dtype=torch.bfloat16, device=device)
    moe = dropless.MoE(shape["D"], shape["F"], shape["E"], shape["K"], **kw)
    x = torch.randn(shape["T"], shape["D"], **kw, requires_grad=True)
    return moe, x, recipe_from_name(RECIPES[variant], fp8_saved_activations=True)


def measure_memory(shape: dict, variant: str, backward: bool = True) -> dict:
    """Saved-activation bytes of one `dropless.MoE` layer forward (bf16 weights and input)."""
    import dropless

    moe, x, recipe = _layer(shape, variant)

    def fwd():
        with dropless.autocast(enabled=recipe is not None, recipe=recipe):
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

    moe, x, recipe = _layer(shape, variant, "cuda")

    def step():
        with dropless.autocast(enabled=recipe is not None, recipe=recipe):
            out, _ = moe(x)
        out.float().sum().backward()

    return 1e3 * statistics.median(step_times(step, steps, 2, torch.cuda.synchronize))


def add_arguments(p: argparse.ArgumentParser) -> None:
    for k, v in SHAPE.items():
        p.add_argument(f"--{k}", type=int, default=v, help=f"{k} (default {v})")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument("--no-backward", action="store_true", help="skip the backward (memory: forward)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant on a GPU")
    add_history_arguments(p, "fp8")


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
        figures["memory"][v] = measure_memory(shape, v, backward=not args.no_backward)
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
