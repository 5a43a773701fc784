"""Checks run inside spawned processes: host syncs of an expert-parallel MoE layer.

The layer's counts exchange needs one host copy (the all-to-all splits); nothing else
may read a device value on the host. Counted on CPU with `tests/ops/sync_counter.py`,
on the grouped path (the one CUDA runs: counts kept on the device).
"""

# T tokens per rank, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))

from sync_counter import count_syncs  # noqa: E402

from dropless.nn import MoE  # noqa: E402
from dropless.parallel import ParallelConfig, build_mesh, shard_moe_experts  # noqa: E402

D, F, E, K, T = 16, 8, 8, 2, 6


def _syncs(world, chunks, overlap, bias=False):
    torch.manual_seed(0)
    moe = MoE(D, F, E, K, backend="grouped_mm", bias=bias)
    pm = build_mesh(ParallelConfig(dp_shard=world, ep=world, overlap_chunks=chunks), num_experts=E)
    shard_moe_experts(moe, pm)
    moe.dispatcher.num_chunks, moe.dispatcher.overlap = chunks, overlap
    x = torch.randn(T, D, requires_grad=True)

    def step():
        out, aux = moe(x)
        (out.square().sum() + aux.lb_loss).backward()

    step()  # first call: lazy registrations
    with count_syncs() as found:
        step()
    assert len(found) == 1 and "the one host sync" in found[0], found
    assert torch.isfinite(x.grad).all()


def ep_one_sync(rank, world):
    _syncs(world, 1, False)


def ep_one_sync_chunks_overlap_bias(rank, world):
    _syncs(world, 3, True, bias=True)


def fp8_weight_cache_per_step_when_distributed(rank, world):
    """In a torch.distributed run the FP8 weight is still quantized once per optimizer
    step (the one weight cache, `ops.weight_cache`): FSDP2 refills gathered weights
    without moving their version counter, and the optimizer step is what says they
    changed."""
    from dropless.quant import MXFP8BlockScaling
    from dropless.quant.gemm import quantize_operand

    w = torch.nn.Parameter(torch.randn(2, 32, 64))
    recipe = MXFP8BlockScaling()
    first = quantize_operand(recipe, w, "w", 2, key=w)
    assert quantize_operand(recipe, w, "w", 2, key=w) is first  # the next micro-batch
    shard = torch.nn.Parameter(torch.zeros(1))
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w):
        w.mul_(2)  # what FSDP2's all-gather copy-in does to the unsharded weight
    torch.optim.SGD([shard], lr=0.1).step()  # the sharded parameters' update
    second = quantize_operand(recipe, w, "w", 2, key=w)
    torch.testing.assert_close(second.dequantize(), 2 * first.dequantize())


CHECKS = [
    "ep_one_sync",
    "ep_one_sync_chunks_overlap_bias",
    "fp8_weight_cache_per_step_when_distributed",
]
