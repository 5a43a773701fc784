"""What `dropless train` needs from `dropless.parallel`, in one object.

    par = parallelize_for_training(model, cfg.parallel, world)   # None for one process
    ... loss.backward()
    norm = par.clip_grad_norm_(params, max_norm)                  # FSDP averaged the grads
    stats = par.pop_stats()                                       # EP time split and bytes

With several processes every run goes through FSDP2 (HSDP when dp_replicate > 1) and,
with ep > 1, expert parallelism of the model's Transformers experts modules; with cp > 1
the model's attention runs across the cp ranks of each sequence
(`dropless.parallel.context`: all-gather-KV causal attention).
"""

from __future__ import annotations

import torch
from torch import nn

from ...hf.distributed.parallelize import ModelLayout, parallelize_config
from ...parallel.mesh import as_parallel_config
from ..run.collectives import all_reduce


class TrainParallel:
    """A model spread over the mesh (`hf.distributed.parallelize.ModelLayout`): gradient
    clipping and the EP figures, reduced over the processes."""

    def __init__(self, layout: ModelLayout):
        self.layout, self.pmesh = layout, layout.pmesh

    @property
    def cp(self) -> int:
        """The context-parallel size: the ranks each sequence is split over."""
        return self.pmesh.config.cp

    @property
    def cp_rank(self) -> int:
        """This rank's index among the cp ranks of its sequences."""
        return self.pmesh.cp_rank

    @property
    def data_rank(self) -> int:
        """Which data-parallel group (of world / cp) this rank reads the samples of."""
        return self.pmesh.dp_rank

    def clip_grad_norm_(self, params, max_norm: float) -> float:
        return self.layout.clip_grad_norm_(params, max_norm)

    def pop_stats(self) -> dict:
        """This step's forward time split (s, mean over ranks) and the activation bytes
        sent to other ranks per step (all ranks, forward + backward)."""
        t = self.layout.ep_sums()
        if t is None:
            return {}
        all_reduce(t, group=self.pmesh.dp_group)
        w = self.pmesh.world_size
        return {
            "ep_dispatch_s": float(t[0]) / w,
            "ep_expert_s": float(t[1]) / w,
            "ep_combine_s": float(t[2]) / w,
            "ep_bytes_per_step": int(t[3]),
        }


def parallelize_for_training(
    model: nn.Module, parallel_cfg, world: int, compute_dtype: torch.dtype = torch.float32
) -> TrainParallel | None:
    """Shard a dropless-patched Transformers model per `parallel_cfg` (fields
    dp_replicate, dp_shard, cp, ep; see `ParallelConfig`); with cp > 1 switch its attention
    to the context-parallel one. Returns None for one process
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
    # the public call's path (`dropless.parallelize`), from the run's [parallel] section
    return TrainParallel(
        parallelize_config(model, as_parallel_config(parallel_cfg), mixed_precision=compute_dtype)
    )
