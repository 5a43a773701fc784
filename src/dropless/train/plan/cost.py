"""The planner's step-time estimate: a per-layer cost model whose inputs are stated.

Compute: the expert GEMMs at the grouped-GEMM rate measured on the H200 for one
Qwen3-30B-A3B layer (E=128, K=8, D=2048, F=768, T=16,384, bf16 forward + backward in
9.59 ms, BENCHMARKS.md: 3.71 TFLOP / 9.59 ms = 387 TFLOP/s), everything else (attention
projections and scores, routers, the LM head) at the measured bf16 dense GEMM rate
(~790 TFLOP/s). Training is 3 forwards' worth (2 for LoRA's frozen base: input
gradients only), plus one more forward with activation checkpointing (the recompute).
Under expert parallelism the busiest rank computes `skew` times the mean rows.

Communication, by GPU kind: the expert all-to-all moves K rows of D values per token in
the compute dtype, dispatch and combine, forward and backward (and the recompute), the
(ep - 1) / ep share that leaves the rank, at the all-to-all bandwidth (NVLink inside a
node of 8 GPUs, 50 GB/s per GPU between nodes); it is not overlapped unless
parallel.overlap_chunks > 1. FSDP2 all-gathers the parameters twice per micro-batch
(forward, and backward after resharding) in the compute dtype and reduce-scatters fp32
gradients, overlapped with compute: the step takes the longer of the two.

It is an estimate: none of these rates was measured on the layout being planned.
"""

from __future__ import annotations

from dataclasses import dataclass

H200_DENSE_TFLOPS = 790.0  # bf16 dense GEMM, measured
H200_GROUPED_TFLOPS = 387.0  # Qwen3-30B-A3B layer forward + backward, measured
GPUS_PER_NODE = 8
INTER_NODE_GBS = 50.0  # 400 Gb/s per GPU (InfiniBand / RoCE)
A2A_EFFICIENCY = 0.7  # share of the link an all-to-all of 10-100 MB messages reaches


@dataclass(frozen=True)
class GpuKind:
    name: str
    compute_vs_h200: float  # bf16 tensor-core throughput relative to the H200 (spec sheets)
    nvlink_gbs: float  # NVLink bandwidth per GPU, one direction
    hbm_tbs: float  # HBM bandwidth


GPUS = {
    "h100": GpuKind("h100", 1.0, 450.0, 3.35),  # same SM count and clocks as the H200
    "h200": GpuKind("h200", 1.0, 450.0, 4.8),
    "b200": GpuKind("b200", 2.2, 900.0, 8.0),
}


def gpu_kind(name: str) -> GpuKind:
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r}: allowed GPU kinds are {', '.join(GPUS)}")
    return GPUS[name]


def _link_gbs(group: int, gpu: GpuKind) -> float:
    return gpu.nvlink_gbs if group <= GPUS_PER_NODE else INTER_NODE_GBS


@dataclass
class Workload:
    """What one rank does in one micro-batch (counts from the traced model)."""

    tokens: int  # this rank's tokens per micro-batch
    seq_len: int
    top_k: int
    hidden: int
    moe_layers: int
    expert_params: int  # one expert's weights (gate_up + down)
    dense_params: int  # weights every token multiplies (FlopCounter.dense_params)
    attn_per_seq_l2: float  # FlopCounter.attn_per_seq_l2
    dense_shard_params: int  # parameters FSDP2 gathers on the dense mesh (whole model)
    expert_fsdp_params: int  # expert parameters FSDP2 gathers (this EP rank's experts)
    dp_shard: int
    ep: int
    act_bytes: int  # 2 for bf16 compute, 4 for fp32
    frozen_base: bool
    checkpointing: bool
    overlap: bool


def step_estimate(w: Workload, gpu: GpuKind, skew: float, grad_accum: int) -> dict:
    """Seconds per optimizer step and tokens/s per GPU, with the parts."""
    passes = (2.0 if w.frozen_base else 3.0) + (1.0 if w.checkpointing else 0.0)
    rate = 1e12 * gpu.compute_vs_h200 * (1.0 if w.act_bytes == 2 else 0.5)  # fp32: TF32-ish
    busiest = skew if w.ep > 1 else 1.0
    expert_flops = passes * 2.0 * w.tokens * w.top_k * w.expert_params * w.moe_layers * busiest
    # this rank's share of sequences: a fraction under context parallelism (1/cp of each)
    sequences = w.tokens / max(w.seq_len, 1)
    dense_flops = passes * (
        2.0 * w.tokens * w.dense_params + sequences * w.attn_per_seq_l2 * w.seq_len**2
    )
    compute_s = expert_flops / (rate * H200_GROUPED_TFLOPS) + dense_flops / (
        rate * H200_DENSE_TFLOPS
    )
    a2a_passes = 4 + (2 if w.checkpointing else 0)  # dispatch + combine: fwd, bwd, recompute
    a2a_bytes = a2a_passes * w.tokens * w.top_k * w.hidden * w.act_bytes * w.moe_layers
    a2a_bytes *= (w.ep - 1) / w.ep
    a2a_s = a2a_bytes / (A2A_EFFICIENCY * _link_gbs(w.ep, gpu) * 1e9) if w.ep > 1 else 0.0
    fsdp_s = 0.0
    # an expert FSDP group's ranks are ep apart (ep is the inner mesh dim): inside one node
    # only when the whole dp_shard group is
    for params, group in ((w.dense_shard_params, w.dp_shard), (w.expert_fsdp_params, w.dp_shard // w.ep)):  # fmt: skip
        if group > 1:
            share = (group - 1) / group
            moved = params * share * (2 * w.act_bytes + 4)  # 2 gathers + fp32 reduce-scatter
            fsdp_s += moved / (_link_gbs(w.dp_shard, gpu) * 1e9)
    micro_s = max(compute_s, fsdp_s) + (0.0 if w.overlap else a2a_s)
    if w.overlap:
        micro_s = max(micro_s, a2a_s)
    step_s = micro_s * grad_accum
    return {
        "step_s": step_s,
        "tokens_per_s_per_gpu": w.tokens * grad_accum / step_s if step_s > 0 else 0.0,
        "compute_s": compute_s * grad_accum,
        "all_to_all_s": a2a_s * grad_accum,
        "fsdp_s": fsdp_s * grad_accum,
    }


def cost_assumptions(gpu: GpuKind) -> dict:
    """The cost model's inputs, as the plan's `assumptions` state them."""
    return {
        "throughput": "an estimate from a per-layer cost model, not a measurement",
        "grouped_gemm_tflops": H200_GROUPED_TFLOPS * gpu.compute_vs_h200,
        "dense_gemm_tflops": H200_DENSE_TFLOPS * gpu.compute_vs_h200,
        "rates_measured_on": "H200 (bf16); other GPU kinds scaled by their spec-sheet ratio",
        "nvlink_gb_per_s": gpu.nvlink_gbs,
        "inter_node_gb_per_s": INTER_NODE_GBS,
        "gpus_per_node": GPUS_PER_NODE,
        "all_to_all_efficiency": A2A_EFFICIENCY,
        "fsdp": "all-gathers and reduce-scatters overlap compute; the all-to-all does not "
        "unless parallel.overlap_chunks > 1",
    }
