"""Checks run inside spawned processes: FSDP2 / HSDP x EP training == one process.

A tiny net (linear -> MoE with a shared expert -> linear) trains a few AdamW steps
with gradient clipping on a fresh global batch per step. The reference trains on
the whole batch in one process; the parallel run gives each data-parallel rank its
slice (mean loss per rank; FSDP averages gradients over the world). Losses, the
clipped norm and every parameter (gathered to full) must match (fp32, rtol 1e-5).
"""

# T tokens per rank, D model dim, F expert hidden dim, E experts

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from dropless.nn import MoE
from dropless.parallel import (
    ParallelConfig,
    apply_fsdp,
    build_mesh,
    clip_grad_norm_,
    shard_moe_experts,
)

D, F, E, T, STEPS, MAX_NORM = 8, 16, 8, 4, 3, 0.3
RTOL, ATOL = 1e-5, 1e-6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE(D, F, E, 2, shared_expert_intermediate_size=8)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        y, aux = self.moe(h)
        return self.out(h + y), aux


def _loss(net, x, y):
    pred, aux = net(x)
    return nn.functional.mse_loss(pred, y) + 0.01 * aux.lb_loss


def _batches(world):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(world * T, D, generator=g), torch.randn(world * T, D, generator=g))
        for _ in range(STEPS)
    ]


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _train(world, dtype=torch.float32, **cfg):
    torch.manual_seed(0)
    net = Net().to(dtype)
    data = [(x.to(dtype), y.to(dtype)) for x, y in _batches(world)]
    rtol, atol = (RTOL, ATOL) if dtype == torch.float32 else (1e-7, 1e-9)
    ref = copy.deepcopy(net)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses, ref_norms = [], []
    for x, y in data:
        loss = _loss(ref, x, y)
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        opt_r.step()
        opt_r.zero_grad()
        ref_losses.append(float(loss.detach()))
    assert max(ref_norms) > MAX_NORM, "clipping never active: the check would not test it"

    pm = build_mesh(ParallelConfig(**cfg), num_experts=E)
    par = copy.deepcopy(net)
    shard_moe_experts(par, pm)
    apply_fsdp(par, pm)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    r = pm.dp_rank
    for step, (x, y) in enumerate(data):
        sl = slice(r * T, (r + 1) * T)
        loss = _loss(par, x[sl], y[sl])
        loss.backward()
        norm = clip_grad_norm_(list(par.parameters()), MAX_NORM)
        opt.step()
        opt.zero_grad()
        lsum = loss.detach().clone()
        dist.all_reduce(lsum)
        torch.testing.assert_close(float(lsum) / world, ref_losses[step], rtol=rtol, atol=atol)
        torch.testing.assert_close(float(norm), ref_norms[step], rtol=rtol, atol=atol)
    ref_params = dict(ref.named_parameters())
    names = []
    for name, p in par.named_parameters():
        torch.testing.assert_close(
            _full(p.detach()),
            ref_params[name].detach(),
            rtol=rtol,
            atol=atol,
            msg=lambda m, n=name: f"{n}: {m}",
        )
        names.append(name)
    assert sorted(names) == sorted(ref_params), (names, list(ref_params))
    return par


def fsdp_only(rank, world):
    _train(world, dp_shard=world)


def fsdp_x_ep(rank, world):
    par = _train(world, dp_shard=world, ep=2)
    w = par.moe.experts.gate_up_proj
    assert w.device_mesh.ndim == 2 and w.to_local().shape[0] <= E // 2, (
        w.device_mesh,
        w.placements,
    )


def fsdp_x_ep_full(rank, world):
    _train(world, dp_shard=world, ep=world)


def fsdp_x_ep_fp64(rank, world):
    """ep = world in float64: a shard group of 1 whose reduce dtype takes FSDP's
    pre/post-divide path (the experts' gradients were divided by the world twice)."""
    _train(world, torch.float64, dp_shard=world, ep=world)


def fsdp_x_ep_overlap(rank, world):
    _train(world, dp_shard=world, ep=world, overlap_chunks=2)


def hsdp_x_ep(rank, world):
    _train(world, dp_replicate=2, dp_shard=world // 2, ep=world // 2)


def hsdp_only(rank, world):
    _train(world, dp_replicate=world, dp_shard=1)


FSDP_CHECKS_2 = ["fsdp_only", "fsdp_x_ep", "fsdp_x_ep_overlap", "hsdp_only"]
FSDP_CHECKS_4 = ["fsdp_x_ep", "fsdp_x_ep_full", "hsdp_x_ep"]
