"""FSDP2 / HSDP over the mesh, and gradient clipping across mixed DTensor meshes.

Dense parameters: `fully_shard` on dp_shard (HSDP over dp_replicate). Expert parameters
(DTensor Shard(0) on "ep"): their own `fully_shard` on dp_shard_mod_ep, divided by the
world size (docs/parallel.md, "Gradient scaling"). One FSDP2 unit takes one dtype of
trainable parameters, so a submodule in another dtype (the fp32 router of a bf16 model)
becomes its own unit, uncast; a replicated submodule inside an expert module is a unit on
the dense mesh, so its gradient is summed over every rank.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from .experts import EPGroupedExperts


def apply_fsdp(
    model: nn.Module,
    pmesh,
    *,
    blocks: list[nn.Module] | None = None,
    reshard_after_forward: bool = True,
    mp_policy=None,
) -> nn.Module:
    """Wrap `model` with FSDP2 per the mesh (in place; returns it).

    blocks: modules to make separate FSDP units on the dense mesh (default: every
    `dropless.nn.MoE`; for a Transformers model pass its decoder layers). Expert
    modules sharded by `shard_moe_experts` / `shard_hf_experts` always get their own
    unit on the expert mesh. Call after sharding the experts and before building the
    optimizer.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from ..nn.moe import MoE

    kw = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    world = pmesh.world_size
    for m in model.modules():
        # an HF experts module (see hf/distributed/expert_parallel.py)
        hf_ep = "_dropless_ep" in m.__dict__
        if isinstance(m, EPGroupedExperts) or hf_ep:
            # dropless.nn experts: several chunks may call forward_sorted in one step, keep
            # them gathered. HF experts run once per layer: reshard as the dense units do, so
            # no unsharded expert copy outlives its layer's forward.
            keep = {} if hf_ep else {"reshard_after_forward": False}
            for child in _replicated_children(m):
                fully_shard(child, mesh=pmesh.dense_fsdp_mesh, **kw)
            fully_shard(m, mesh=pmesh.expert_fsdp_mesh, **{**kw, **keep})
            shard_size = pmesh.expert_shard_size  # dp_shard x cp / ep
            if shard_size == 1:
                # FSDP (2.13) divides a shard group of 1's gradient by the custom factor
                # when it copies it, and again after the reduction when the reduce dtype
                # is neither fp32 nor bf16 (fp64, fp16: its pre/post-divide path), so the
                # experts' gradients came out divided by the world twice. Factor 1 there,
                # and the division by the world after any replica all-reduce.
                m.set_gradient_divide_factor(1.0)
                m.set_all_reduce_hook(functools.partial(_divide_, by=float(world)))
            else:
                m.set_gradient_divide_factor(float(world))
                if "nccl" not in str(dist.get_backend()):
                    # a custom factor means PREMUL_SUM, which gloo lacks: sum, then divide
                    m.set_force_sum_reduction_for_comms(True)
            if not hf_ep:  # HF experts run the dispatch inside their own forward
                register_fsdp_forward_method(m, "forward_sorted")
    units = blocks if blocks is not None else [m for m in model.modules() if isinstance(m, MoE)]
    dense = pmesh.dense_fsdp_mesh
    for b in units:
        if b is not model:
            _shard_other_dtypes(b, dense, kw)
            fully_shard(b, mesh=dense, **kw)
    _shard_other_dtypes(model, dense, kw)
    fully_shard(model, mesh=dense, **kw)
    return model


def _divide_(grad: torch.Tensor, by: float) -> None:
    grad.div_(by)


def _managed(unit: nn.Module) -> list[tuple[str, nn.Module, nn.Parameter]]:
    """(owner name, owner, parameter) for what `fully_shard(unit)` would take: the
    parameters below `unit` not under a submodule that is already an FSDP unit."""
    from torch.distributed.fsdp import FSDPModule

    out, seen, stack = [], set(), [("", unit)]
    while stack:
        name, m = stack.pop()
        for p in m.parameters(recurse=False):
            if id(p) not in seen:  # tied weights: one parameter under two owners
                seen.add(id(p))
                out.append((name, m, p))
        for n, c in m.named_children():
            if not isinstance(c, FSDPModule):
                stack.append((f"{name}.{n}" if name else n, c))
    return out


def _shard_other_dtypes(unit: nn.Module, mesh, kw: dict) -> None:
    """Make every submodule of `unit` holding trainable parameters in a dtype other than
    most of the unit's (by size) its own FSDP unit, keeping that dtype (no param_dtype
    cast). Frozen parameters may differ (a bf16 base under fp32 LoRA adapters)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    managed = _trainable(_managed(unit))  # FSDP2 checks the trainable ones (frozen: any)
    size: dict = {}
    for _, _, p in managed:
        size[p.dtype] = size.get(p.dtype, 0) + p.numel()
    if len(size) < 2:
        return
    main = max(size, key=size.get)
    owners = {id(m): (n, m) for n, m, p in managed if p.dtype != main}
    policy = kw.get("mp_policy")
    keep = MixedPrecisionPolicy(reduce_dtype=getattr(policy, "reduce_dtype", None))
    for name, m in owners.values():
        dtypes = {p.dtype for _, _, p in _trainable(_managed(m))}
        if m is unit or len(dtypes) > 1:
            raise ValueError(
                f"FSDP2 takes one parameter dtype per unit, and {type(m).__name__} "
                f"{name or '(the unit itself)'!r} holds parameters in "
                f"{sorted(str(d) for d in dtypes | {main})} with no submodule to split them "
                "off; store the model in one dtype (model.dtype=fp32)"
            )
        fully_shard(m, mesh=mesh, **{**kw, "mp_policy": keep})


def _trainable(managed: list) -> list:
    return [t for t in managed if t[2].requires_grad]


def _replicated_children(m: nn.Module) -> list[nn.Module]:
    """The submodules of an expert module whose parameters are not expert-sharded
    DTensors (replicated on every EP rank); raises for such a parameter held by the
    module itself, which no unit could reduce over every rank."""
    from torch.distributed.tensor import DTensor

    direct = [n for n, p in m.named_parameters(recurse=False) if not isinstance(p, DTensor)]
    if direct:
        raise ValueError(
            f"{type(m).__name__}: parameters {direct} are not sharded over the experts, and FSDP2 "
            "would reduce their gradients over the expert mesh only; train it with parallel.ep=1"
        )
    return [
        c
        for c in m.children()
        if any(True for _ in c.parameters())
        and not any(isinstance(p, DTensor) for p in c.parameters())
    ]


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters on different meshes.

    Gradients are grouped by (mesh, placements); each group's norm is reduced to a
    full (replicated) value by DTensor, the groups are combined, and every gradient
    is scaled by min(1, max_norm / total). Returns the total norm (plain tensor).
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for gs in groups.values():
        n = torch.nn.utils.get_total_norm(gs, norm_type, error_if_nonfinite=False, foreach=False)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        norms.append(n.float())
    if math.isinf(norm_type):
        total = torch.stack(norms).max()
    else:
        total = torch.stack([n**norm_type for n in norms]).sum() ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for gs in groups.values():
        for g in gs:
            g.mul_(coef.to(g.dtype))
    return total
