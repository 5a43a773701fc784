"""What `dropless train` needs from `dropless.parallel`, in one object.

    par = parallelize_for_training(model, cfg.parallel, world)   # None for one process
    ... loss.backward()
    norm = par.clip_grad_norm_(params, max_norm)                  # FSDP averaged the grads
    stats = par.pop_stats()                                       # EP time split and bytes

With several processes every run goes through FSDP2 (HSDP when dp_replicate > 1) and,
with ep > 1, expert parallelism of the model's Transformers experts modules.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ...hf.distributed.expert_parallel import hf_dispatchers, shard_hf_experts
from ...parallel.fsdp import apply_fsdp, clip_grad_norm_
from ...parallel.mesh import ParallelMesh, as_parallel_config, build_mesh
from ..run.collectives import all_reduce


class _QuietRedistribution(logging.Filter):
    """DTensor warns on every rank that a redistribution over the (dp, ep) mesh takes two
    collectives; the layout is deliberate and the warning says nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "suboptimal" not in record.getMessage()


def quiet_dtensor_warnings() -> None:
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _QuietRedistribution) for f in log.filters):
        log.addFilter(_QuietRedistribution())


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    for name, m in model.named_modules():
        if name.endswith("layers") and isinstance(m, nn.ModuleList):
            return list(m)
    return []


class TrainParallel:
    """A model spread over the mesh: gradient clipping and EP stats."""

    def __init__(self, model: nn.Module, pmesh: ParallelMesh):
        self.model, self.pmesh = model, pmesh

    def clip_grad_norm_(self, params, max_norm: float) -> float:
        return float(clip_grad_norm_(list(params), max_norm))

    def pop_stats(self) -> dict:
        """This step's forward time split (s, mean over ranks) and the activation bytes
        sent to other ranks per step (all ranks, forward + backward)."""
        ds = hf_dispatchers(self.model)
        if not ds:
            return {}
        t = torch.zeros(4, dtype=torch.float64)
        for d in ds:
            s = d.pop_stats()
            t += torch.tensor(
                [s["dispatch_s"], s["expert_s"], s["combine_s"], 2.0 * s["bytes_sent"]],
                dtype=torch.float64,
            )
        all_reduce(t, group=self.pmesh.dp_group)
        w = self.pmesh.world_size
        return {
            "ep_dispatch_s": float(t[0]) / w,
            "ep_expert_s": float(t[1]) / w,
            "ep_combine_s": float(t[2]) / w,
            "ep_bytes_per_step": int(t[3]),
        }


def mixed_precision_policy(compute_dtype: torch.dtype):
    """FSDP2's policy for a run computing in `compute_dtype`: parameters all-gathered and
    used in that dtype, gradients reduced in fp32 (None for fp32 compute)."""
    if compute_dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def parallelize_for_training(
    model: nn.Module, parallel_cfg, world: int, compute_dtype: torch.dtype = torch.float32
) -> TrainParallel | None:
    """Shard a dropless-patched Transformers model per `parallel_cfg` (fields
    dp_replicate, dp_shard, ep; see `ParallelConfig`). Returns None for one process
    (after checking ep == 1), unless parallel.force_distributed: then one process takes
    the parallel path too, in the 1-process group `init_env` joined. compute_dtype: the
    run's autocast dtype; with bf16 every FSDP2 unit gathers bf16 parameters and reduces
    fp32 gradients."""
    from ...hf.layers import moe_layers

    layers = moe_layers(model)
    num_experts = layers[0].num_experts if layers else None
    if world == 1 and not as_parallel_config(parallel_cfg).force_distributed:
        from ...parallel.mesh import resolve_sizes

        resolve_sizes(parallel_cfg, 1, num_experts)  # ep > 1 on one process: a clear error
        return None
    quiet_dtensor_warnings()
    pm = build_mesh(parallel_cfg, num_experts)
    shard_hf_experts(model, pm)
    apply_fsdp(
        model, pm, blocks=decoder_layers(model), mp_policy=mixed_precision_policy(compute_dtype)
    )
    return TrainParallel(model, pm)
