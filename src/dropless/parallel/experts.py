"""Expert weights sharded over the EP axis: DTensor Shard(0), E/ep experts per rank.

Choice: the expert parameters are DTensors `Shard(0)` on the "ep" mesh (global
shape [E, ...], local [E/ep, ...]) rather than plain local slices, so that
`state_dict()` and torch.distributed.checkpoint see the global tensors and a
checkpoint saved with one EP size loads with another, and so FSDP2 can shard them
further over dp_shard_mod_ep (its FSDP x TP path). The expert compute itself runs
on `to_local()` views, so the grouped GEMM never sees a DTensor.
"""

# T tokens, D model dim, F expert hidden dim, E experts (global), L local experts, S rows

from __future__ import annotations

from torch import nn

from ..nn.experts import GroupedExperts
from ..ops.expert_mlp import grouped_mlp

PARAM_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def _local(t):
    if t is None:
        return None
    return t.to_local() if hasattr(t, "to_local") else t


class EPGroupedExperts(GroupedExperts):
    """GroupedExperts whose parameters hold experts [r*L, (r+1)*L) of this EP rank.

    Only `forward_sorted` (called by `ExpertParallelDispatcher` on rows already sent
    to this rank) is valid; `forward` raises, since the local path would need every
    expert.
    """

    num_global_experts: int
    num_local_experts: int

    @classmethod
    def from_experts(cls, experts: GroupedExperts, ep_mesh) -> EPGroupedExperts:
        """Shard a full `GroupedExperts` (identical on every rank: seeded init or a
        loaded checkpoint) over `ep_mesh` without communication."""
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(experts, GroupedExperts):
            raise TypeError(
                f"experts must be a dropless GroupedExperts, got {type(experts).__name__}"
            )
        P, r = ep_mesh.size(), ep_mesh.get_local_rank()
        E = experts.num_experts
        if E % P:
            raise ValueError(f"num_experts={E} is not divisible by parallel.ep={P}")
        L = E // P
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for k in ("num_experts", "hidden_size", "intermediate_size", "activation", "backend"):
            setattr(new, k, getattr(experts, k))
        new.num_global_experts, new.num_local_experts = E, L
        for name in PARAM_NAMES:
            p = getattr(experts, name)
            if p is None:
                setattr(new, name, None)
                continue
            local = p.detach()[r * L : (r + 1) * L].clone()
            d = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            new.register_parameter(name, nn.Parameter(d, requires_grad=p.requires_grad))
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
        return grouped_mlp(
            x_SD,
            counts,
            prob_S,
            _local(self.gate_up_proj),
            _local(self.down_proj),
            gate_up_bias=_local(self.gate_up_proj_bias),
            down_bias=_local(self.down_proj_bias),
            activation=self.activation,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", local_experts={self.num_local_experts}"


def shard_moe_experts(model: nn.Module, pmesh) -> list[str]:
    """Expert-parallelise every `dropless.nn.MoE` in `model` in place.

    Each MoE's experts become `EPGroupedExperts` (Shard(0) over pmesh's "ep" axis)
    and its dispatcher an `ExpertParallelDispatcher` over the EP group, summing
    counts over the data-parallel group. With ep == 1 the experts stay whole and the
    dispatcher only sums the counts over the data-parallel group (so the balancing
    loss is the global-batch one for every EP size). Returns the names of the MoE
    modules changed.
    """
    from ..nn.moe import MoE
    from .dispatcher import ExpertParallelDispatcher, GlobalCountsDispatcher

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
            m.experts = EPGroupedExperts.from_experts(m.experts, pmesh.ep_mesh)
            m.dispatcher = ExpertParallelDispatcher(
                pmesh.ep_group,
                pmesh.dp_group,
                num_experts=m.num_experts,
                num_chunks=cfg.overlap_chunks,
                overlap=cfg.overlap_chunks > 1,
            )
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
