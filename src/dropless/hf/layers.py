"""Find the MoE layers of a Transformers model; per-layer token counts; saving stock layout.

An experts module is an instance of a class Transformers decorates with
`@use_experts_implementation` (`is_experts_module`); its MoE block is its parent.

The trainer uses `moe_layers(model)` to reach each layer's router, its expert score bias
(for `dropless.ops.update_expert_bias`) and the tokens each expert received, and
`save_hf` to write a checkpoint that stock Transformers loads.
"""

# L MoE layers, E experts

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .patching.routers import router_bias


@dataclass
class MoELayer:
    """One MoE block of a Transformers model.

    name: module path of the block (e.g. "model.layers.0.mlp"); block, experts, router:
    the modules (router is None when the block has no `gate`/`router` child); num_experts:
    the experts module's (all the model's experts, however they are laid out).
    """

    name: str
    block: nn.Module
    experts: nn.Module
    router: nn.Module | None
    router_name: str | None
    family: str
    num_experts: int

    @property
    def expert_bias(self) -> torch.Tensor | None:
        """The score bias [E] the block routes with (e_score_correction_bias or equivalent, or
        the expert_bias dropless added); None if there is none."""
        return router_bias(self.router, self.block)

    @property
    def tokens_per_expert(self) -> torch.Tensor | None:
        """int64 [E]: pairs routed to each expert in the last dropless forward (None before one)."""
        return self.experts.__dict__.get("_dropless_last_counts_E")


def family_of(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    return str(getattr(config, "model_type", None) or type(module).__name__)


def is_experts_module(module: nn.Module) -> bool:
    """True for an instance of a class decorated with `@use_experts_implementation`."""
    return (
        hasattr(module, "has_gate")
        and hasattr(module, "is_transposed")
        and hasattr(module, "config")
    )


def _find_router(block: nn.Module) -> tuple[str | None, nn.Module | None]:
    for attr in ("gate", "router"):
        mod = getattr(block, attr, None)
        if isinstance(mod, nn.Module) and hasattr(mod, "weight") and hasattr(mod, "top_k"):
            return attr, mod
    return None, None


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every MoE block of `model` (those holding a v5 experts module), in module order."""
    layers = []
    modules = dict(model.named_modules())
    for name, mod in modules.items():
        if not is_experts_module(mod):
            continue
        owner = name
        while owner.endswith(".base_layer"):  # PEFT wraps it (LoRA on its weights)
            owner = owner[: -len(".base_layer")]
        block_name = owner.rpartition(".")[0]
        block = modules[block_name] if block_name else model
        attr, router = _find_router(block)
        router_name = None if attr is None else (f"{block_name}.{attr}" if block_name else attr)
        layers.append(
            MoELayer(
                block_name, block, mod, router, router_name, family_of(mod), int(mod.num_experts)
            )
        )
    return layers


def tokens_per_expert(model: nn.Module, reset: bool = True) -> torch.Tensor | None:
    """int64 [L, E]: pairs each expert received, summed over dropless forwards since the
    last reset (so gradient-accumulation micro-batches add up). None before any forward."""
    rows, found = [], False
    for layer in moe_layers(model):
        counts = layer.experts.__dict__.get("_dropless_counts_E")
        found = found or counts is not None
        if counts is None:
            counts = torch.zeros(layer.num_experts, dtype=torch.int64)
        rows.append(counts.to("cpu", torch.int64))
        if reset:
            layer.experts.__dict__.pop("_dropless_counts_E", None)
    if not found:
        return None
    return torch.stack(rows)


def added_state_keys(model: nn.Module) -> list[str]:
    """State-dict keys that exist only because dropless patched the model."""
    keys = []
    for layer in moe_layers(model):
        if layer.router is not None and layer.router.__dict__.get("_dropless_added_bias"):
            keys.append(f"{layer.router_name}.expert_bias")
    return keys


def save_hf(model: nn.Module, out_dir: str | Path, **save_kwargs) -> Path:
    """Write `model` as a stock Transformers checkpoint (safetensors + config) in `out_dir`.

    Buffers dropless added (the routers' `expert_bias`) are left out, so stock
    `from_pretrained(out_dir)` loads it without unexpected keys. Extra keyword arguments
    go to `save_pretrained`. A model laid out by `dropless.parallelize` (DTensor parameters:
    FSDP2 shards, expert-parallel experts) is gathered tensor by tensor: every rank must call
    this, and rank 0 writes.
    """
    import torch.distributed as dist

    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"save_hf needs a transformers PreTrainedModel, got {type(model).__name__}")
    drop = set(added_state_keys(model))
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    state = {}
    for k, v in model.state_dict().items():
        if k in drop:
            continue
        if hasattr(v, "full_tensor"):  # a DTensor: every rank takes part in the gather
            v = v.full_tensor().detach().cpu()
        if rank == 0:
            state[k] = v
    out = Path(out_dir)
    if rank == 0:
        # gathered already: the DistributedConfig `dropless.parallelize` sets (for Trainer)
        # would make save_pretrained gather again, a collective the other ranks are not in
        config = model.config
        layout = config.__dict__.pop("distributed_config", None)
        try:
            model.save_pretrained(out, state_dict=state, **save_kwargs)
        finally:
            if layout is not None:
                config.distributed_config = layout
    return out
