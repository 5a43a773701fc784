"""One expert-parallel implementation for both front ends: `shard_expert_params` shards a
module's named expert parameters (DTensor `Shard(0)` over "ep", this rank's rows), and
`shard_moe_experts` (dropless.nn) and `shard_hf_experts` (Transformers) both go through
it and through `ep_dispatcher`: the same weights give the same local shards, the same
dispatcher and the same error for an expert count ep does not divide, and both local
experts (`LocalExperts`) compute the same rows.

In this process, over torch's fake process group (rank 1 of 2, collectives move
nothing): sharding copies the local rows and communicates nothing, and `forward_sorted`
runs on local views only."""

# T tokens, D model dim, F expert hidden dim, E experts, L local experts, S sorted rows

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")

from dropless.hf.distributed.expert_parallel import hf_dispatchers, shard_hf_experts
from dropless.nn import MoE
from dropless.parallel import (
    EPGroupedExperts,
    ExpertParallelDispatcher,
    ParallelConfig,
    build_mesh,
    shard_moe_experts,
)
from dropless.parallel.experts import LocalExperts, local_view, shard_expert_params

WORLD, RANK, E, D, F = 2, 1, 4, 8, 6
L = E // WORLD
ROWS = slice(RANK * L, (RANK + 1) * L)  # the experts this rank holds


@pytest.fixture
def pm():
    """An ep=2 mesh on which this process is rank 1 (fake process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        yield build_mesh(ParallelConfig(ep=WORLD), num_experts=E, device_type="cpu")
    finally:
        dist.destroy_process_group()


def _assert_shard(p: nn.Parameter, full: torch.Tensor, pm) -> None:
    from torch.distributed.tensor import DTensor, Shard

    assert isinstance(p, nn.Parameter) and isinstance(p.data, DTensor)
    assert p.device_mesh == pm.ep_mesh and tuple(p.placements) == (Shard(0),)
    assert p.shape == full.shape  # the global shape: names and shapes as checkpoints see them
    torch.testing.assert_close(p.to_local(), full[ROWS], rtol=0, atol=0)
    torch.testing.assert_close(local_view(p), full[ROWS], rtol=0, atol=0)


def test_shard_expert_params_on_a_plain_module(pm):
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(E, 3, 2))
    m.b = nn.Parameter(torch.randn(E, 3), requires_grad=False)
    m.bias = None
    m.other = nn.Parameter(torch.randn(5))
    full_w, full_b, other = m.w.detach().clone(), m.b.detach().clone(), m.other
    names = shard_expert_params(m, ("w", "b", "bias", "absent"), pm.ep_mesh, num_experts=E)
    assert names == ["w", "b"]  # None and absent names are skipped
    _assert_shard(m.w, full_w, pm)
    _assert_shard(m.b, full_b, pm)
    assert m.w.requires_grad and not m.b.requires_grad
    assert m.other is other and m.bias is None  # parameters not named stay as they were
    assert [n for n, _ in m.named_parameters()] == ["w", "b", "other"]
    assert local_view(None) is None and local_view(other) is other


def _tiny_hf_experts(num_experts: int) -> nn.Module:
    """A Qwen3-MoE experts module (gate_up_proj [E, 2F, D], down_proj [E, D, F]) on the
    dropless path, in a block `moe_layers` finds."""
    import dropless
    from dropless.hf.patching.discovery import experts_classes, tiny_experts

    dropless.patch()
    (cls,) = [c.cls for c in experts_classes() if c.family == "qwen3_moe"]
    experts = tiny_experts(cls, hidden=D, intermediate=F, experts=num_experts, dtype=torch.float32)
    experts.config._experts_implementation = "dropless"
    block = nn.Module()
    block.experts = experts
    holder = nn.Module()
    holder.block = block
    return holder


def _tiny_moe(num_experts: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(MoE(D, F, num_experts, 2))


def test_both_front_ends_shard_alike(pm):
    hf = _tiny_hf_experts(E)
    experts = hf.block.experts
    assert experts.gate_up_proj.shape == (E, 2 * F, D)
    moe = _tiny_moe(E)
    with torch.no_grad():  # the same weights in the same (v5) layout
        moe[0].experts.gate_up_proj.copy_(experts.gate_up_proj)
        moe[0].experts.down_proj.copy_(experts.down_proj)
    full = {n: getattr(experts, n).detach().clone() for n in ("gate_up_proj", "down_proj")}
    assert shard_moe_experts(moe, pm) == ["0"]
    assert shard_hf_experts(hf, pm) == ["block"]
    ep = moe[0].experts
    assert isinstance(ep, EPGroupedExperts)
    for name, t in full.items():
        _assert_shard(getattr(ep, name), t, pm)
        _assert_shard(getattr(experts, name), t, pm)
        torch.testing.assert_close(
            getattr(ep, name).to_local(), getattr(experts, name).to_local(), rtol=0, atol=0
        )
    # the same dispatcher for both
    (d_hf,) = hf_dispatchers(hf)
    d_nn = moe[0].dispatcher
    for d in (d_hf, d_nn):
        assert type(d) is ExpertParallelDispatcher
        assert (d.num_experts, d.num_chunks, d.overlap) == (E, 1, False)
        assert d.ep_group is pm.ep_group and d.dp_group is pm.dp_group

    # both local experts are `LocalExperts` and compute the same rows
    local_hf = experts.__dict__["_dropless_ep"][0]
    assert isinstance(ep, LocalExperts) and isinstance(local_hf, LocalExperts)
    assert ep.num_global_experts == local_hf.num_global_experts == E
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 2])
    x_SD = torch.randn(int(counts.sum()), D, generator=g)
    prob_S = torch.rand(int(counts.sum()), generator=g)
    torch.testing.assert_close(
        ep.forward_sorted(x_SD, counts, prob_S), local_hf.forward_sorted(x_SD, counts, prob_S)
    )


def test_both_front_ends_refuse_an_uneven_split_alike(pm):
    """ep=2 does not divide 3 experts: the one check, naming the module."""
    with pytest.raises(ValueError) as nn_err:
        shard_moe_experts(_tiny_moe(3), pm)
    assert str(nn_err.value) == (
        "0 (dropless.nn.MoE): num_experts=3 is not divisible by parallel.ep=2; "
        "pick an ep that divides 3"
    )
    with pytest.raises(ValueError) as hf_err:
        shard_hf_experts(_tiny_hf_experts(3), pm)
    assert str(hf_err.value) == (
        "block (qwen3_moe): num_experts=3 is not divisible by parallel.ep=2; "
        "pick an ep that divides 3"
    )
