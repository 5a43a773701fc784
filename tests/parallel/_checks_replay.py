"""Routing replay under expert parallelism (run inside the spawned groups): dropless.MoE
and a Transformers Qwen3-MoE under gradient checkpointing.

Every rank checkpoints its EP MoE layer (fp64), then changes the expert score bias
before backward, so a recompute that routed again would send tokens to other experts
and other ranks. With replay every gradient equals the one-process run without
checkpointing and unchanged bias, and the counts exchange ran once (in the forward).
"""

# T tokens per rank, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from dropless.nn import MoE
from dropless.parallel import ParallelConfig, build_mesh, dispatchers, shard_moe_experts

D, F, E, K, T = 8, 6, 6, 2, 5


def _close(name, got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def ep_routing_replay(rank, world):
    torch.manual_seed(0)
    moe = MoE(D, F, E, K, expert_bias=True, dtype=torch.float64)
    x_all = torch.randn(world * T, D, dtype=torch.float64)
    g_all = torch.randn(world * T, D, dtype=torch.float64)

    ref = copy.deepcopy(moe)  # one process, whole batch, no checkpointing
    xr = x_all.clone().requires_grad_(True)
    ((ref(xr)[0] * g_all).sum()).backward()

    pm = build_mesh(ParallelConfig(dp_shard=world, ep=world), num_experts=E)
    ep = copy.deepcopy(moe)
    shard_moe_experts(ep, pm)
    disp = dispatchers(ep)[0]
    exchanges = []
    plain = disp._exchange_counts
    disp._exchange_counts = lambda *a: exchanges.append(1) or plain(*a)
    sl = slice(rank * T, (rank + 1) * T)
    x = x_all[sl].clone().requires_grad_(True)
    out = checkpoint(lambda v: ep(v)[0], x, use_reentrant=False)
    with torch.no_grad():  # the same new bias on every rank: routing changes everywhere
        g = torch.Generator().manual_seed(7)
        ep.router.expert_bias.add_(torch.randn(E, generator=g) * 5.0)
        moved = ep.router(x_all).ids_TK != ref.router(x_all).ids_TK
    assert bool(moved.any()), "the perturbation must change the routing for the check to bite"
    (out * g_all[sl]).sum().backward()

    assert len(exchanges) == 1, f"counts exchanged {len(exchanges)} times, want 1 (forward only)"
    _close("x.grad", x.grad, xr.grad[sl])
    ref_params = dict(ref.named_parameters())
    L = E // world
    for name, p in ep.named_parameters():
        want = ref_params[name].grad
        if hasattr(p, "to_local"):
            _close(f"{name}.grad", p.grad.to_local(), want[rank * L : (rank + 1) * L])
        else:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            _close(f"{name}.grad", grad, want)


def hf_ep_routing_replay(rank, world):
    """The same on a Transformers Qwen3-MoE under gradient checkpointing (every layer)."""
    from _checks_hf import E as HF_E
    from _checks_hf import V, _model

    import dropless
    from dropless.hf import moe_layers
    from dropless.hf.distributed.expert_parallel import hf_dispatchers, shard_hf_experts

    B, L = 2, 5
    model = dropless.patch_model(_model(), expert_bias=True).double()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (world * B, L), generator=g)
    w = torch.randn(world * B, L, V, generator=g, dtype=torch.float64)
    ref = copy.deepcopy(model)
    (ref(input_ids=ids).logits * w).sum().backward()

    ep = copy.deepcopy(model)
    shard_hf_experts(ep, build_mesh(ParallelConfig(ep=world), num_experts=HF_E))
    ep.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ep.train()
    exchanges = []
    for disp in hf_dispatchers(ep):
        plain = disp._exchange_counts
        disp._exchange_counts = lambda *a, plain=plain: exchanges.append(1) or plain(*a)
    sl = slice(rank * B, (rank + 1) * B)
    logits = ep(input_ids=ids[sl]).logits
    with torch.no_grad():
        for layer in moe_layers(ep):
            layer.expert_bias.add_(torch.randn(HF_E, generator=g) * 5.0)
    (logits * w[sl]).sum().backward()

    layers = len(moe_layers(ep))
    assert len(exchanges) == layers, f"{len(exchanges)} counts exchanges for {layers} layers"
    rp = dict(ref.named_parameters())
    Le = HF_E // world
    for name, p in ep.named_parameters():
        if hasattr(p, "to_local"):
            got, want = p.grad.to_local(), rp[name].grad[rank * Le : (rank + 1) * Le]
        else:
            got, want = p.grad.clone(), rp[name].grad
            dist.all_reduce(got)
        _close(f"{name}.grad", got, want)
