"""`dropless plan [CONFIG.toml] [--set KEY=VALUE ...] --gpus N --gpu-memory-gib G
[--gpu h100|h200|b200] [--skew 1.5] [--json]`."""

from __future__ import annotations

import argparse

EPILOG = """\
How the figures are made (every assumption is also in the JSON's "assumptions"):
  memory     traced, not computed: the model is built on the meta device as `dropless
             train` builds it, sharded (expert parallelism, FSDP2/HSDP, mixed precision)
             over a fake process group of N ranks, and one micro-batch's forward and
             backward (the trainer's own step function) run on fake tensors under
             torch's memory tracker, with the optimizer state of a second step in
             place. peak_gib_per_gpu is tensor memory (what torch.cuda.max_memory_allocated
             reads). model.path may hold only config.json.
  experts    the expert MLP cannot run on fake tensors (data-dependent counts, the counts
             exchange, Triton kernels): what its op declares it keeps for backward is
             allocated instead, the busiest expert-parallel rank computing --skew x the
             mean rows.
             max_skew: the skew at which the layout stops fitting (dropless layers have no
             capacity limit); with ep=1 skew changes nothing.
  attention  sdpa / FlashAttention traced as the GPU kernels keep it (output and fp32
             log-sum-exp, no [L, L] scores); eager and flex_attention as they run.
  reserve    0.75 GiB CUDA context, 0.5 GiB NCCL with several GPUs, 5% of the peak for
             fragmentation; fits = peak + reserve <= --gpu-memory-gib.
  throughput an ESTIMATE from a per-layer cost model: expert GEMMs at 387 TFLOP/s (the H200
             Qwen3-30B-A3B layer measurement), other GEMMs at 790 TFLOP/s (H200 bf16 dense),
             scaled for --gpu; NVLink 450 GB/s (h100/h200), 900 (b200), 50 GB/s between
             nodes of 8; all-to-all at 70% of the link, not overlapped unless
             parallel.overlap_chunks > 1; FSDP traffic overlapped with compute.
  activations the breakdown is taken at the overall peak; at small micro-batches that is
             the optimizer step, when no activation is alive ("activations 0.00"). The
             activation peak beside it (activation_peak_gib in the JSON) is the most
             activations and backward temporaries held at one moment of forward/backward.
  precision  the trainer's own step: its autocast, its precision.recipe (FP8 / MXFP8;
             h kept in E4M3 with precision.fp8_saved_activations) and router losses.
  not traced gradient clipping (small); precision.dtype=auto is bf16.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("config", nargs="?", default=None, help="TOML config, as for dropless train")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, as for dropless train (repeatable)",
    )  # fmt: skip
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (processes)")
    p.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU in GiB")
    p.add_argument("--gpu", default="h100", choices=("h100", "h200", "b200"), help="GPU kind")
    p.add_argument(
        "--skew", type=float, default=1.5,
        help="busiest expert-parallel rank's rows over the mean (default 1.5)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="end with one line of JSON")


def format_plan(p) -> str:
    """The per-GPU breakdown as printed."""
    lay = p.layout
    lines = [
        f"dropless plan: {p.gpus} x {p.gpu} ({p.gpu_memory_gib:g} GiB); ep={lay['ep']} "
        f"dp_shard={lay['dp_shard']}"
        + (f" cp={lay['cp']}" if lay.get("cp", 1) > 1 else "")
        + f" dp_replicate={lay['dp_replicate']}, micro-batch "
        f"{lay['micro_batch']} x {lay['seq_len']}"
        + (
            f" (each sequence over {lay['cp']} GPUs: {lay['tokens_per_gpu']} tokens per GPU)"
            if lay.get("cp", 1) > 1
            else ""
        )
        + f", {lay['finetune']}, parameters "
        f"{lay['model_dtype']}, compute {lay['compute_dtype']}, checkpointing "
        f"{'on' if lay['activation_checkpointing'] else 'off'}",
        f"per GPU (GiB), the breakdown at the traced peak ({p.peak_moment}):",
    ]
    for k, v in p.breakdown_gib.items():
        line = f"  {k:<20} {v:10.2f}"
        if k == "activations":  # at the peak moment; their own peak may fall elsewhere
            line += f"   (activation peak in forward/backward: {p.activation_peak_gib:.2f})"
        lines.append(line)
    if p.peak_moment == "optimizer step":
        lines += [
            "  (the traced peak is the optimizer step, when no activation is alive; activations",
            "   are counted at their own peak, above, with the backward's temporaries)",
        ]
    if p.activation_peak_other_checkpointing_gib is not None:
        other = "off" if lay["activation_checkpointing"] else "on"
        lines.append(
            f"  (activation peak with checkpointing {other}: "
            f"{p.activation_peak_other_checkpointing_gib:.2f})"
        )
    if lay["ep"] > 1:
        lines.append(f"  all-to-all buffers of one layer at skew {p.skew}: {p.all_to_all_gib:.2f}")
    lines += [
        f"  {'peak':<20} {p.peak_gib_per_gpu:10.2f}",
        f"  {'reserve':<20} {p.reserve_gib:10.2f}",
        f"verdict: {'fits' if p.fits else 'does NOT fit'} "
        f"({p.peak_gib_per_gpu + p.reserve_gib:.1f} of {p.gpu_memory_gib:g} GiB); "
        + (
            f"stops fitting at skew {p.max_skew}"
            if lay["ep"] > 1
            else "routing skew does not change memory with ep=1"
        ),
        f"estimate: {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {p.step_s_estimate:.3f} s "
        "per step (cost model, not a measurement; see --help)",
    ]
    return "\n".join(lines)


def run(args) -> int:
    from ..train.config.load import load_config
    from ..train.plan.trace import make_plan
    from .messages import say_error
    from .train import one_line

    try:
        cfg = load_config(args.config, args.overrides)
        if args.gpus < 1 or args.gpu_memory_gib <= 0:
            raise ValueError(
                f"--gpus {args.gpus} --gpu-memory-gib {args.gpu_memory_gib:g}: expected at least "
                "one GPU and a positive memory size"
            )
        p = make_plan(cfg, args.gpus, args.gpu_memory_gib, args.gpu, args.skew)
    except ValueError as e:
        if getattr(args, "debug", False):
            raise
        say_error(f"dropless plan: error: {one_line(e)}")
        return 2
    print(format_plan(p), flush=True)
    if args.json:
        print(p.to_json(), flush=True)
    return 0 if p.fits else 1
