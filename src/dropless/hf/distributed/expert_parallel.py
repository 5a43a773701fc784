"""Expert parallelism for Transformers v5 MoE models patched with `dropless.patch`: each
experts module gets `dropless.nn.MoE`'s (`dropless.parallel.experts`): DTensor weights (and
its own LoRA factors) `Shard(0)` over "ep", an `ExpertParallelDispatcher`, `_LocalExperts`
for the rows this rank received. It keeps its forward, names and global shapes, so DCP
checkpoints reshard. What runs expert-parallel and what is refused: docs/parallel.md.
"""

# T tokens, D model dim, E experts (global), L local experts, K top-k, S rows

from __future__ import annotations

from torch import nn

from ...parallel.experts import ep_dispatcher, local_weights, shard_expert_params
from ..experts.forward import experts_spec, sorted_experts
from ..lora.expert_lora import LORA_PARAMS, attached_lowrank

#: the expert tensors of a v5 experts module, sharded over ep (gated experts: gate_up_proj;
#: non-gated ones, such as Nemotron-H's relu^2: up_proj)
EXPERT_PARAMS = (
    "gate_up_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj_bias",
    "up_proj_bias",
    "down_proj_bias",
)


class _LocalExperts:
    """What the dispatcher calls (`dropless.parallel.experts.LocalExperts`): the local slice
    of one HF experts module, run by `hf.experts.forward.sorted_experts` (every form the
    single-process path runs) on the rows this rank received, with this rank's shards of
    the module's own LoRA factors. The dispatcher applies the routing weight at home
    (prob_S is None), after any per-row norm, as one process does."""

    def __init__(self, module: nn.Module, spec, num_experts: int):
        self.module, self.spec, self.num_global_experts = module, spec, num_experts
        first = "gate_up_proj" if spec.gated else "up_proj"
        self.names = (first, "down_proj")
        if spec.has_bias:
            self.names += (first + "_bias", "down_proj_bias")

    def weights(self):
        """(w1, w2, b1, b2): this rank's experts' weights and biases (None without)."""
        w = local_weights(self.module, self.names)
        return w if len(w) == 4 else (*w, None, None)

    def forward_sorted(self, x_SD, counts, prob_S):
        lora = attached_lowrank(self.module)
        return sorted_experts(self.module, self.spec, x_SD, counts, prob_S, *self.weights(), lora)


def shard_hf_experts(model: nn.Module, pmesh) -> list[str]:
    """Expert-parallelise every experts module of a dropless-patched HF model in place.

    Every rank must hold the same full weights first, or the model is on the meta device
    (then `load_sharded_hf` fills each rank's shards). Returns the names of the MoE blocks
    changed; no-op when ep == 1 unless parallel.force_distributed (the 1-rank EP path)."""
    from ..layers import moe_layers

    cfg = pmesh.config
    if cfg.ep == 1 and not cfg.force_distributed:
        return []
    done = []
    for layer in moe_layers(model):
        m = layer.experts
        if "_dropless_ep" in m.__dict__:
            continue
        spec = experts_spec(m)
        if isinstance(spec, str):  # the stock forward would need every expert on each rank
            raise ValueError(
                f"{layer.name} ({layer.family}): expert parallelism runs the dropless experts "
                f"path, and this module runs its own forward ({spec}). Train it with parallel.ep=1."
            )
        E = int(m.num_experts)
        where = f"{layer.name} ({layer.family})"
        # LoRA factors the module owns shard with their experts
        shard_expert_params(
            m, (*EXPERT_PARAMS, *LORA_PARAMS), pmesh.ep_mesh, num_experts=E, where=where
        )
        # the "dropless" experts implementation runs it (`dropless_experts_forward`)
        m.__dict__["_dropless_ep"] = (_LocalExperts(m, spec, E), ep_dispatcher(pmesh, E))
        done.append(layer.name)
    return done


def hf_dispatchers(model: nn.Module) -> list:
    """The expert-parallel dispatchers of a model sharded by `shard_hf_experts`."""
    return [m.__dict__["_dropless_ep"][1] for m in model.modules() if "_dropless_ep" in m.__dict__]
