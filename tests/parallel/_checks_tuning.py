"""Checks run inside spawned processes: the expert engine's tuned GEMM choice under expert
parallelism is the same on every rank, whatever rows each rank received.

Rank 0 tunes the layer's shape ahead of the run (`dropless bench tune`'s `tune_shapes`,
with a fake timer) into a cache file every rank's run reads. Then an expert-parallel
`dropless.nn.MoE` on `expert_path="gathered"` runs forward and backward: each rank plans
on the rows the all-to-all gave it (their number differs between the ranks), times
nothing, makes no stand-in operand, and picks what the cache holds. The row-gathering
kernels are torch stand-ins (the Triton ones run on CUDA only), so the result is checked
against the whole batch in one process.
"""

# T tokens per rank, D model dim, F expert hidden dim, E experts (global), L local, K top-k

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist

from dropless.bench.tune import tune_shapes
from dropless.nn import MoE
from dropless.ops.activation.eager import act_bwd_eager, act_fwd_eager
from dropless.ops.expert_mlp import eager as mlp_eager
from dropless.ops.expert_mlp import plan as mlp_plan
from dropless.ops.grouped_gemm.backends import GEMM_BACKENDS
from dropless.ops.specs import ActivationConfig
from dropless.parallel import ParallelConfig, build_mesh, shard_moe_experts

D, F, E, K, T = 8, 16, 8, 2, 12
FUSED = mlp_plan.FUSED
# what the fake timer finds faster: the row-gathering kernel for these GEMMs only
FASTER_FUSED = ("up", "down_wgrad")


def _rows(x, index):
    return x if index is None else x.index_select(0, index)


def _host(counts):
    return counts.tolist() if isinstance(counts, torch.Tensor) else counts


def _loop():
    return GEMM_BACKENDS.entries["loop"]


def _up_act(x, index, gate_up, counts, prob, trans_w, interleaved, kind, alpha, limit):
    h = _loop().mm(_rows(x, index), gate_up, _host(counts), trans_w)
    return h, act_fwd_eager(h, prob, interleaved, kind, alpha, limit)


def _down_dact(g, index, down, counts, h, prob, trans_w, interleaved, need_gp, recompute,
               kind, alpha, limit):  # fmt: skip
    da = _loop().mm(_rows(g, index), down, _host(counts), not trans_w)
    return act_bwd_eager(da, h, prob, interleaved, need_gp, recompute, kind, alpha, limit)


def _wgrad(a, b, counts, index_a, index_b):
    return _loop().wgrad(_rows(a, index_a), _rows(b, index_b), _host(counts))


# torch stand-ins of the row-gathering kernels (`gather_gemm_kernels.py`), on any device
TORCH_GATHER = mlp_plan.GatherKernels(
    _up_act, _down_dact, _wgrad, supports=lambda x, w: True, kinds=("swiglu",), name="torch"
)


def _shared_dir() -> str:
    box = [tempfile.mkdtemp(prefix="dropless-tuning-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one directory on this machine for every rank
    return box[0]


def _tune(path: str, L: int) -> dict:
    """Rank 0's offline tuning of the local layer shape (L, K, D, F) into `path`."""
    saved = mlp_plan._candidates

    def candidates(g, kernels, be, ops, args):  # (GEMM, implementation) for the timer
        return {be.name: lambda: (g, be.name), FUSED: lambda: (g, FUSED)}

    def timer(fn):
        g, impl = fn()
        return 1.0 if (impl == FUSED) == (g in FASTER_FUSED) else 2.0

    mlp_plan._candidates = candidates
    try:
        tuner = mlp_plan.GemmTuner(path, timer=timer)
        return tune_shapes([(L, K, D, F)], T, torch.float32, "cpu", ActivationConfig(), tuner)
    finally:
        mlp_plan._candidates = saved


def ep_ranks_pick_the_same_gemms(rank, world):
    L = E // world
    d = _shared_dir()
    path = os.path.join(d, "dropless", "tuning.json")
    kernels = mlp_plan.GATHER_KERNELS
    saved_entries, saved_hook = dict(kernels.entries), kernels._gpu_hook
    saved_plan, saved_stand_ins = mlp_eager.plan_expert_mlp, mlp_plan._stand_ins
    saved_xdg = os.environ.get("XDG_CACHE_HOME")
    kernels.entries.clear()
    kernels.register(TORCH_GATHER)
    kernels._gpu_hook = None
    try:
        tuned = _tune(path, L)[(L, K, D, F)] if rank == 0 else None
        dist.barrier()  # the cache is written before any rank plans

        torch.manual_seed(0)
        moe = MoE(D, F, E, K)
        with torch.no_grad():  # skewed routing: the ranks receive different rows (checked)
            moe.router.weight[:L] += 0.5
        x_all, g_all = torch.randn(world * T, D), torch.randn(world * T, D)
        ref = copy.deepcopy(moe)  # the whole batch in one process, on the default path
        xr = x_all.clone().requires_grad_(True)
        out_r, aux_r = ref(xr)
        (out_r * g_all).sum().backward()

        # the run: the default tuner reads $XDG_CACHE_HOME/dropless/tuning.json
        os.environ["XDG_CACHE_HOME"] = d
        mlp_plan._TUNER.clear()
        mlp_plan.set_expert_path("gathered")
        planned = []

        def recording_plan(x, *args, **kwargs):
            plan = saved_plan(x, *args, **kwargs)
            planned.append((int(x.shape[0]), plan.describe()))
            return plan

        def no_stand_ins(*args, **kwargs):
            raise AssertionError("a cached choice makes no stand-in operand")

        mlp_eager.plan_expert_mlp, mlp_plan._stand_ins = recording_plan, no_stand_ins
        pm = build_mesh(ParallelConfig(dp_shard=world, ep=world), num_experts=E)
        ep = copy.deepcopy(moe)
        shard_moe_experts(ep, pm)
        sl = slice(rank * T, (rank + 1) * T)
        x = x_all[sl].clone().requires_grad_(True)
        out, _ = ep(x)
        (out * g_all[sl]).sum().backward()

        torch.testing.assert_close(out, out_r[sl], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.grad, xr.grad[sl], rtol=1e-5, atol=1e-6)
        w = ep.experts.gate_up_proj.grad.to_local()
        torch.testing.assert_close(w, ref.experts.gate_up_proj.grad[rank * L : (rank + 1) * L])
        assert len(planned) == 1, planned
        every = [None] * world
        dist.all_gather_object(every, planned[0])
        rows = [r for r, _ in every]
        assert len(set(rows)) == world, f"the ranks received the same rows: {rows}"
        box = [tuned if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        assert [c for _, c in every] == [box[0]] * world, (every, box[0])
        picks = dict(p.split("=") for p in box[0].split())
        assert sorted(g for g, impl in picks.items() if impl == FUSED) == sorted(FASTER_FUSED)
    finally:
        kernels.entries.clear()
        kernels.entries.update(saved_entries)
        kernels._gpu_hook = saved_hook
        mlp_eager.plan_expert_mlp, mlp_plan._stand_ins = saved_plan, saved_stand_ins
        mlp_plan.set_expert_path("auto")
        mlp_plan._TUNER.clear()
        if saved_xdg is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = saved_xdg


CHECKS = ["ep_ranks_pick_the_same_gemms"]
