"""Expert parallelism for Transformers v5 MoE models patched with `dropless.patch`.

`shard_hf_experts(model, pmesh)` turns each experts module's weights into DTensors
`Shard(0)` over the "ep" axis (this rank keeps experts [r*L, (r+1)*L)) and gives the
module instance a forward that sends tokens through `ExpertParallelDispatcher`; the
grouped MLP on the local experts uses the same layout flags as the single-process
dropless path (`dropless.hf.experts_spec`). The stock router is untouched. Expert
parameters keep their names and global shapes, so DCP checkpoints reshard.
"""

# T tokens, D model dim, E experts (global), L local experts, K top-k, S rows

from __future__ import annotations

import types

from torch import nn

from ..ops.expert_mlp import grouped_mlp
from ..parallel.experts import PARAM_NAMES, _local


class _LocalExperts:
    """What the dispatcher calls: the local slice of one HF experts module."""

    def __init__(self, module: nn.Module, spec, num_experts: int):
        self.module, self.spec, self.num_global_experts = module, spec, num_experts

    def forward_sorted(self, x_SD, counts, prob_S):
        m, s = self.module, self.spec
        return grouped_mlp(
            x_SD,
            counts,
            prob_S,
            _local(m.gate_up_proj),
            _local(m.down_proj),
            gate_up_bias=_local(m.gate_up_proj_bias) if s.has_bias else None,
            down_bias=_local(m.down_proj_bias) if s.has_bias else None,
            activation=s.activation,
            trans_w=s.trans_w,
        )


def _ep_forward(self, hidden_states, top_k_index, top_k_weights):
    from .experts import CALLS, _record_counts

    local, disp = self.__dict__["_dropless_ep"]
    x_TD = hidden_states.to(_local(self.gate_up_proj).dtype)
    out_TD, tokens_per_expert_E, _, _ = disp(x_TD, top_k_index.long(), top_k_weights, local, None)
    _record_counts(self, tokens_per_expert_E)  # this rank's tokens; reduce across ranks
    CALLS[local.spec.family] += 1
    return out_TD.to(hidden_states.dtype)


def shard_hf_experts(model: nn.Module, pmesh) -> list[str]:
    """Expert-parallelise every experts module of a dropless-patched HF model in place.

    Every rank must hold the same full weights first (same seed or the same
    checkpoint). Returns the names of the MoE blocks changed; no-op when ep == 1.
    Raises ValueError for an experts module dropless cannot run (the stock fallback
    has no expert-parallel path here).
    """
    from torch.distributed.tensor import DTensor, Shard

    from ..parallel.dispatcher import ExpertParallelDispatcher
    from .experts import experts_spec
    from .layers import moe_layers

    cfg = pmesh.config
    if cfg.ep == 1:
        return []
    P, r = pmesh.ep_mesh.size(), pmesh.ep_mesh.get_local_rank()
    done = []
    for layer in moe_layers(model):
        m = layer.experts
        if "_dropless_ep" in m.__dict__:
            continue
        spec = experts_spec(m)
        if isinstance(spec, str):
            raise ValueError(
                f"{layer.name}: expert parallelism needs the dropless experts path: {spec}"
            )
        E = int(m.num_experts)
        if E % P:
            raise ValueError(f"{layer.name}: num_experts={E} is not divisible by parallel.ep={P}")
        L = E // P
        for name in PARAM_NAMES:
            p = getattr(m, name, None)
            if not isinstance(p, nn.Parameter):
                continue
            local = p.detach()[r * L : (r + 1) * L].clone()
            d = DTensor.from_local(local, pmesh.ep_mesh, [Shard(0)], run_check=False)
            setattr(m, name, nn.Parameter(d, requires_grad=p.requires_grad))
        disp = ExpertParallelDispatcher(
            pmesh.ep_group,
            pmesh.dp_group,
            num_experts=E,
            num_chunks=cfg.overlap_chunks,
            overlap=cfg.overlap_chunks > 1,
        )
        m.__dict__["_dropless_ep"] = (_LocalExperts(m, spec, E), disp)
        m.forward = types.MethodType(_ep_forward, m)
        done.append(layer.name)
    return done


def hf_dispatchers(model: nn.Module) -> list:
    """The expert-parallel dispatchers of a model sharded by `shard_hf_experts`."""
    return [m.__dict__["_dropless_ep"][1] for m in model.modules() if "_dropless_ep" in m.__dict__]
