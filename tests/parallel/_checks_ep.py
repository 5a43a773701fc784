"""Checks run inside spawned processes: expert parallelism == one process.

Every rank builds the same seeded MoE and the same global batch; the reference runs
the whole batch in one process (here, on every rank), the EP run feeds each rank
its slice. Loss = sum(out * G) + lb / world, so the per-rank losses sum to the
reference loss and every gradient must match (fp32, rtol 1e-5).
"""

# T tokens per rank, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dropless.nn import MoE
from dropless.parallel import ParallelConfig, build_mesh, dispatchers, shard_moe_experts

D, F, E, T = 8, 16, 8, 6
RTOL, ATOL = 1e-5, 1e-6


def _close(name, got, want):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _case(world, routing="uniform", top_k=2, bias=False, shared=0, chunks=1, overlap=False):
    rank = dist.get_rank()
    torch.manual_seed(0)
    moe = MoE(D, F, E, top_k, bias=bias, shared_expert_intermediate_size=shared)
    if bias:
        with torch.no_grad():
            moe.experts.gate_up_proj_bias.normal_()
            moe.experts.down_proj_bias.normal_()
    x_all = torch.randn(world * T, D)
    if routing != "uniform":
        x_all = x_all.abs() + 0.1  # positive inputs: a positive router row always wins
        with torch.no_grad():
            w = moe.router.weight
            if routing == "one_expert":  # every token's first choice is expert 0
                w.fill_(-1.0)
                w[0].fill_(1.0)
            elif routing == "last_rank_idle":  # experts of the last EP rank never chosen
                w[-(E // world) :].fill_(-5.0)
    g_all = torch.randn(world * T, D)

    # reference: one process, whole batch
    ref = copy.deepcopy(moe)
    xr = x_all.clone().requires_grad_(True)
    out_r, aux_r = ref(xr)
    ((out_r * g_all).sum() + aux_r.lb_loss).backward()

    pm = build_mesh(ParallelConfig(dp_shard=world, ep=world, overlap_chunks=chunks), num_experts=E)
    ep = copy.deepcopy(moe)
    shard_moe_experts(ep, pm)
    ep.dispatcher.num_chunks, ep.dispatcher.overlap = chunks, overlap
    sl = slice(rank * T, (rank + 1) * T)
    x = x_all[sl].clone().requires_grad_(True)
    out, aux = ep(x)
    ((out * g_all[sl]).sum() + aux.lb_loss / world).backward()

    _close("out", out, out_r[sl])
    _close("x.grad", x.grad, xr.grad[sl])
    lb = aux.lb_loss.detach().clone()
    dist.all_reduce(lb)
    _close("lb_loss", lb / world, aux_r.lb_loss.detach())
    tpe = aux.tokens_per_expert.clone()
    dist.all_reduce(tpe)
    assert torch.equal(tpe, aux_r.tokens_per_expert), (tpe, aux_r.tokens_per_expert)
    ref_params = dict(ref.named_parameters())
    L = E // world
    for name, p in ep.named_parameters():
        want = ref_params[name].grad
        if hasattr(p, "to_local"):  # expert weights: this rank's slice of experts
            _close(f"{name}.grad", p.grad.to_local(), want[rank * L : (rank + 1) * L])
        else:  # dense: each rank saw its tokens only; the sum is the reference
            g = p.grad.clone()
            dist.all_reduce(g)
            _close(f"{name}.grad", g, want)
    stats = dispatchers(ep)[0].pop_stats()
    assert stats["calls"] == 1 and stats["bytes_sent"] >= 0
    return aux_r.tokens_per_expert


def ep_uniform(rank, world):
    _case(world)


def ep_skewed_one_expert(rank, world):
    tpe = _case(world, routing="one_expert", top_k=1)
    assert int(tpe[0]) == world * T  # every token on expert 0: ranks > 0 receive nothing


def ep_last_rank_receives_nothing(rank, world):
    tpe = _case(world, routing="last_rank_idle")
    assert int(tpe[-(E // world) :].sum()) == 0


def ep_bias_and_shared_expert(rank, world):
    _case(world, bias=True, shared=12)


def ep_chunked_no_overlap(rank, world):
    _case(world, chunks=2)


def ep_chunked_overlap(rank, world):
    _case(world, chunks=3, overlap=True)


def ep_more_chunks_than_tokens(rank, world):
    _case(world, chunks=T + 2, overlap=True)  # empty chunks on every rank


def ep_overlap_skewed(rank, world):
    _case(world, routing="one_expert", top_k=1, chunks=2, overlap=True)


def bad_mesh_in_group(rank, world):
    for kw, needle in (
        (dict(dp_shard=world + 1), "must equal the world size"),
        (dict(ep=3), "must divide parallel.dp_shard"),
    ):
        try:
            build_mesh(ParallelConfig(**kw), num_experts=E)
        except ValueError as e:
            assert needle in str(e), str(e)
        else:
            raise AssertionError(f"{kw} did not raise")
    try:
        build_mesh(ParallelConfig(ep=world), num_experts=world * 3 + 1)
    except ValueError as e:
        assert "not divisible by parallel.ep" in str(e), str(e)
    else:
        raise AssertionError("num_experts not divisible did not raise")


EP_CHECKS = [
    "ep_uniform",
    "ep_skewed_one_expert",
    "ep_last_rank_receives_nothing",
    "ep_bias_and_shared_expert",
    "ep_chunked_no_overlap",
    "ep_chunked_overlap",
    "ep_overlap_skewed",
    "ep_more_chunks_than_tokens",
    "bad_mesh_in_group",
]
