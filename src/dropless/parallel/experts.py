"""Expert parallelism, one implementation for `dropless.nn.MoE` (`shard_moe_experts`) and
Transformers models (`dropless.hf.shard_hf_experts`): both go through `shard_expert_params`,
`ep_dispatcher` and `LocalExperts`. Rank r holds experts [r*L, (r+1)*L) as DTensor
`Shard(0)` parameters, not plain local slices, so checkpoints reshard and FSDP2 can shard
them further (docs/parallel.md); the expert compute runs on their `to_local()` views.
"""

# T tokens, D model dim, F expert hidden dim, E experts (global), L local experts, S rows

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..nn.experts import GroupedExperts
from ..ops.expert_mlp import grouped_mlp

PARAM_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


@runtime_checkable
class LocalExperts(Protocol):
    """This rank's experts, as `ExpertParallelDispatcher` calls them.

    `forward_sorted(x_SD, counts, prob_S)`: rows sorted by local expert, `counts` [L]
    rows each, `prob_S` the routing weight of each row (None: applied by the caller);
    returns [S, D]. `num_global_experts`: E over every EP rank.
    """

    num_global_experts: int

    def forward_sorted(self, x_SD, counts, prob_S) -> torch.Tensor: ...


def local_view(t):
    """This rank's slice of a sharded parameter (`to_local()`), the tensor itself when it is
    not a DTensor, None for None."""
    if t is None:
        return None
    return t.to_local() if hasattr(t, "to_local") else t


def local_weights(module: nn.Module, names: Iterable[str]) -> tuple:
    """`local_view` of each named attribute of `module` (None where it has none)."""
    return tuple(local_view(getattr(module, n, None)) for n in names)


def shard_expert_params(
    module: nn.Module, names: Iterable[str], ep_mesh, *, num_experts: int, where: str = ""
) -> list[str]:
    """Shard the expert parameters `names` of `module` over `ep_mesh`, in place, copied
    from the full tensor every rank holds (no communication). Returns the names sharded."""
    P, r = ep_mesh.size(), ep_mesh.get_local_rank()
    E = int(num_experts)
    if E % P:
        raise ValueError(
            f"{where + ': ' if where else ''}num_experts={E} is not divisible by "
            f"parallel.ep={P}; pick an ep that divides {E}"
        )
    from torch.distributed.tensor import DTensor, Shard

    L = E // P
    done = []
    for name in names:
        p = getattr(module, name, None)
        if not isinstance(p, nn.Parameter):
            continue
        local = p.detach()[r * L : (r + 1) * L].clone()
        d = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(module, name, nn.Parameter(d, requires_grad=p.requires_grad))
        done.append(name)
    return done


def ep_dispatcher(pmesh, num_experts: int):
    """The `ExpertParallelDispatcher` of one MoE layer of `num_experts` experts over
    pmesh's "ep" group, summing counts over its data-parallel group, chunked and
    overlapped as `parallel.overlap_chunks` asks."""
    from .dispatcher import ExpertParallelDispatcher

    c = pmesh.config.overlap_chunks
    return ExpertParallelDispatcher(
        pmesh.ep_group, pmesh.dp_group, num_experts=num_experts, num_chunks=c, overlap=c > 1
    )


class EPGroupedExperts(GroupedExperts):
    """GroupedExperts holding experts [r*L, (r+1)*L) of this EP rank: a `LocalExperts`
    (`forward` raises, since the local path would need every expert)."""

    num_global_experts: int
    num_local_experts: int

    @classmethod
    def from_experts(cls, experts: GroupedExperts, ep_mesh, *, where: str = "") -> EPGroupedExperts:
        """Shard a full `GroupedExperts` (identical on every rank: seeded init or a
        loaded checkpoint) over `ep_mesh` without communication (`shard_expert_params`;
        `where` names the module in its error). `experts` itself is left whole."""
        if not isinstance(experts, GroupedExperts):
            raise TypeError(
                f"experts must be a dropless GroupedExperts, got {type(experts).__name__}"
            )
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for k in ("num_experts", "hidden_size", "intermediate_size", "activation", "backend"):
            setattr(new, k, getattr(experts, k))
        for name in PARAM_NAMES:  # the full parameters (or None), then their shards
            setattr(new, name, getattr(experts, name))
        E = experts.num_experts
        shard_expert_params(new, PARAM_NAMES, ep_mesh, num_experts=E, where=where)
        new.num_global_experts, new.num_local_experts = E, E // ep_mesh.size()
        return new

    def reset_parameters(self) -> None:  # weights come from the full module
        raise RuntimeError(
            "EPGroupedExperts takes its weights from the full module; re-init that one"
        )

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "EPGroupedExperts holds only this rank's experts; run it through "
            "dropless.parallel.ExpertParallelDispatcher (MoE.dispatcher), not the local path"
        )

    def forward_sorted(self, x_SD, counts, prob_S):
        """Rows sorted by local expert, `counts` [L] rows each, on the local weights."""
        w1, w2, b1, b2 = local_weights(self, PARAM_NAMES)
        kw = self._mlp_kwargs() | dict(gate_up_bias=b1, down_bias=b2)
        return grouped_mlp(x_SD, counts, prob_S, w1, w2, **kw)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", local_experts={self.num_local_experts}"


def shard_moe_experts(model: nn.Module, pmesh) -> list[str]:
    """Expert-parallelise every `dropless.nn.MoE` in `model` in place; returns the names of
    the MoE modules changed. With ep == 1 the experts stay whole and the dispatcher only sums
    the counts over the data-parallel group (the balancing loss is the global-batch one)."""
    from ..nn.moe import MoE
    from .dispatcher import GlobalCountsDispatcher

    cfg = pmesh.config
    done = []
    for name, m in model.named_modules():
        if not isinstance(m, MoE):
            continue
        if cfg.ep == 1:
            if pmesh.world_size > 1:
                m.dispatcher = GlobalCountsDispatcher(pmesh.dp_group)
                done.append(name)
            continue
        if not isinstance(m.experts, EPGroupedExperts):
            where = f"{name} (dropless.nn.MoE)" if name else "dropless.nn.MoE"
            m.experts = EPGroupedExperts.from_experts(m.experts, pmesh.ep_mesh, where=where)
            m.dispatcher = ep_dispatcher(pmesh, m.num_experts)
            done.append(name)
    return done


def dispatchers(model: nn.Module) -> list:
    """The expert-parallel dispatchers inside `model` (for stats)."""
    from .dispatcher import ExpertParallelDispatcher

    return [
        m.dispatcher
        for m in model.modules()
        if isinstance(getattr(m, "dispatcher", None), ExpertParallelDispatcher)
    ]
