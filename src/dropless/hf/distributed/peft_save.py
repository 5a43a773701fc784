"""A LoRA adapter of a model laid out by `dropless.parallelize`, written in PEFT's format.

PEFT's `save_pretrained` cannot write it: the adapters are DTensors, and the experts' own
factors are not PEFT parameters. `save_lora_adapter` gathers every adapter tensor (a
collective per tensor), converts the experts' factors to PEFT's layout and
`target_parameters`, and writes on rank 0; `route_peft_save` sends a PeftModel's
`save_pretrained` (what `Trainer.save_model` calls on every rank) through it.
"""

from __future__ import annotations

import copy
import types
from pathlib import Path

import torch
from torch import nn


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().contiguous()


def _expert_targets(base: nn.Module, layers) -> list[str]:
    """PEFT's `target_parameters` names of the experts' factors (as `dropless train` writes)."""
    out: list[str] = []
    for x in layers:
        exp = next(n for n, m in x.block.named_children() if m is x.experts)
        local = x.name.rpartition(".")[2]
        prefix = f"{local}.{exp}" if local else exp
        for name in ("gate_up_proj" if x.experts.has_gate else "up_proj", "down_proj"):
            if f"{prefix}.{name}" not in out:
                out.append(f"{prefix}.{name}")
    return out


def _config(model: nn.Module, base: nn.Module, layers):
    """The adapter's LoraConfig: the PeftModel's, with the experts' projections added."""
    import peft

    if hasattr(model, "peft_config"):
        names = list(model.peft_config)
        if len(names) != 1:
            raise ValueError(
                f"save_lora_adapter: the model has the adapters {names}; it writes one "
                "(delete the others with model.delete_adapter(name) first)"
            )
        config = copy.deepcopy(model.peft_config[names[0]])
        if isinstance(config.target_modules, set):  # PEFT's set: written in a fixed order
            config.target_modules = sorted(config.target_modules)
    else:
        config = None
    if not layers:
        if config is None:
            raise ValueError("save_lora_adapter: the model has no LoRA adapter")
        return config
    first = layers[0].experts
    r = int(first.lora_A_first.shape[1])
    alpha = first.__dict__["_dropless_lora_scale"] * r
    if config is None:
        config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=[])
    elif (config.r, float(config.lora_alpha)) != (r, float(alpha)):
        raise ValueError(
            f"save_lora_adapter: the experts' factors have rank {r} and alpha {alpha:g}, the "
            f"PEFT adapters rank {config.r} and alpha {config.lora_alpha:g}; one adapter file "
            "holds one rank and alpha: give attach_expert_lora the LoraConfig's r and lora_alpha"
        )
    config.target_parameters = list(config.target_parameters or []) + _expert_targets(base, layers)
    return config


def lora_adapter_state(model: nn.Module) -> tuple[object, dict[str, torch.Tensor]]:
    """(LoraConfig, the adapter file's tensors on CPU) of `model` (a PeftModel, or a
    Transformers model whose experts carry `attach_expert_lora` factors), gathered from the
    shards: every rank calls this, in the same order (collectives)."""
    from peft.utils import get_peft_model_state_dict

    from ..layers import moe_layers
    from ..lora.expert_lora import expert_factor_keys, factor_to_peft, peft_paths
    from ..lora.peft_lora import base_model

    base = base_model(model)
    is_peft = base is not model
    layers = [x for x in moe_layers(base) if "_dropless_lora_scale" in x.experts.__dict__]
    config = _config(model, base, layers)
    prefix = "base_model.model." if is_peft else ""
    experts = {}
    if layers:
        where = peft_paths(base, config)
        experts = {prefix + k: v for k, v in expert_factor_keys(base, where).items()}
    state: dict[str, torch.Tensor] = {}
    own = {}
    for name, t in model.state_dict().items():
        if name in experts:
            key, kind, _ = experts[name]
            state[key] = factor_to_peft(kind, _full(t)).contiguous()
        elif is_peft and "lora_" in name:
            own[name] = _full(t)
    if is_peft and own:
        adapter = next(iter(model.peft_config))
        state.update(get_peft_model_state_dict(model, state_dict=own, adapter_name=adapter))
    return config, state


def save_lora_adapter(model: nn.Module, out_dir) -> Path:
    """Write `model`'s LoRA adapter as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors) that `PeftModel.from_pretrained(stock_model, out_dir)` loads.
    Every rank calls it (the gathers are collectives); rank 0 writes."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    config, state = lora_adapter_state(model)
    out = Path(out_dir)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def _gathered_save_pretrained(self, save_directory, *args, **kwargs):
    """`PeftModel.save_pretrained` of a model `dropless.parallelize` laid out: every rank
    calls it (Transformers' Trainer does); rank 0 writes (`save_lora_adapter`)."""
    if args or kwargs.get("selected_adapters") or kwargs.get("convert_pissa_to_lora"):
        raise ValueError(
            "save_pretrained of a model laid out by dropless.parallelize takes the directory "
            "only (one adapter, written in PEFT's format by dropless.hf.save_lora_adapter)"
        )
    save_lora_adapter(self, save_directory)


def route_peft_save(model: nn.Module) -> None:
    """Make a PeftModel's `save_pretrained` (what Trainer.save_model calls) gather and write
    through `save_lora_adapter`."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        model.save_pretrained = types.MethodType(_gathered_save_pretrained, model)


def save_expert_lora_as_peft(model: nn.Module, out_dir) -> Path:
    """Write the factors `attach_expert_lora` gave the experts modules of `model` (gathered
    when sharded over ep; every rank calls this, rank 0 writes) as a PEFT adapter
    directory (adapter_config.json + adapter_model.safetensors) that
    `PeftModel.from_pretrained(stock_model, out_dir)` loads: `save_lora_adapter`'s file."""
    from ..layers import moe_layers
    from ..lora.expert_lora import LORA_SCALE

    if not any(LORA_SCALE in x.experts.__dict__ for x in moe_layers(model)):
        raise ValueError(
            "save_expert_lora_as_peft: no experts module carries attach_expert_lora factors"
        )
    return save_lora_adapter(model, out_dir)
