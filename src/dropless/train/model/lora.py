"""LoRA fine-tuning in `dropless train` (`finetune.method = "lora"`; docs/lora.md says
which adapters each module gets, what is saved and how a run ends).

Adapters are added before the model is sharded (`apply_lora`, called by
`build_training_model`): they shard with what they adapt. Their initial values (PEFT's)
are drawn per adapter-file key over the global shape (`init_adapters`), so one process
and any sharding start from the same adapters.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import torch
from torch import nn

from ...hf.lora.peft_lora import base_model

ADAPTER_DIR = "adapter"
_CONFIG = "_dropless_lora_config"  # on the Transformers model: its adapter file's LoraConfig
_ATTENTION_PARENTS = ("self_attn", "attention", "attn", "mixer")


def require_peft():
    try:
        import peft
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "finetune.method='lora' needs peft: pip install 'dropless[lora]'"
        ) from None
    return peft


def lora_targets(model: nn.Module, targets: list[str]) -> tuple[list[str], str | None]:
    """(target_parameters, target_modules regex) for `targets` ("experts", "attention")."""
    from ... import hf

    params: list[str] = []
    if "experts" in targets:
        for layer in hf.moe_layers(model):
            local = layer.name.rpartition(".")[2]
            first = "gate_up_proj" if layer.experts.has_gate else "up_proj"
            exp = next(n for n, m in layer.block.named_children() if m is layer.experts)
            prefix = f"{local}.{exp}" if local else exp
            for name in (first, "down_proj"):
                key = f"{prefix}.{name}"
                if key not in params:
                    params.append(key)
    modules = None
    if "attention" in targets:
        names = set()
        for name, mod in model.named_modules():
            parent, _, leaf = name.rpartition(".")
            if isinstance(mod, nn.Linear) and parent.rpartition(".")[2] in _ATTENTION_PARENTS:
                if not (leaf.endswith("in_proj") or leaf.endswith("out_proj")):  # mamba mixers
                    names.add(leaf)
        if names:
            parents = "|".join(_ATTENTION_PARENTS)
            modules = rf".*\.({parents})\.({'|'.join(sorted(map(re.escape, names)))})"
    if not params and modules is None:
        raise ValueError(
            f"finetune.lora_targets={targets!r} matches nothing in {type(model).__name__}: "
            "no experts module and no attention projection found"
        )
    return params, modules


def owns_expert_factors(model: nn.Module) -> bool:
    """Whether the experts get their own factors (`attach_expert_lora`): every MoE layer
    runs dropless's fused expert MLP (gated or not, no post-expert norm), the path that runs
    them as thin GEMMs (and the one expert parallelism shards); otherwise PEFT's
    `target_parameters` wrap the experts."""
    from ... import hf
    from ...hf.experts import experts_spec
    from ...hf.patching.patch import IMPLEMENTATION

    layers = hf.moe_layers(model)
    for layer in layers:
        impl = getattr(getattr(layer.experts, "config", None), "_experts_implementation", None)
        spec = experts_spec(layer.experts)
        if impl != IMPLEMENTATION or isinstance(spec, str):
            return False
        if spec.path != "fused" or spec.post_norm:
            return False
    return bool(layers)


def lora_config(model: nn.Module, fcfg, base_path: str = "", experts: bool = True):
    """PEFT's LoraConfig for `fcfg` on `model`; experts=False leaves the experts out (their
    factors are the modules' own)."""
    peft = require_peft()
    params, modules = lora_targets(model, list(fcfg.lora_targets))
    return peft.LoraConfig(
        r=fcfg.lora_rank,
        lora_alpha=fcfg.alpha,
        target_parameters=(params if experts else None) or None,
        target_modules=modules if modules is not None else [],
        base_model_name_or_path=base_path or None,
    )


def apply_lora(model: nn.Module, fcfg, base_path: str = "", world: int = 1) -> nn.Module:
    """`model` (already patched, not yet sharded over `world` processes) with the base
    frozen and LoRA on `fcfg.lora_targets`: a PeftModel when PEFT wraps anything, else
    `model` itself. The adapters are fp32 whatever `model.dtype`; their values are set by
    `init_adapters`."""
    require_peft()
    own = "experts" in fcfg.lora_targets and owns_expert_factors(model)
    if world > 1 and "experts" in fcfg.lora_targets and not own:
        raise ValueError(
            f"finetune.method='lora' on {world} processes needs every experts module on "
            "dropless's fused expert MLP (PEFT's target_parameters cannot wrap sharded "
            "expert weights); use model.implementation='dropless', or train on one process, or "
            "set finetune.lora_targets=attention"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    if own:
        from ... import hf
        from ...hf.lora.expert_lora import attach_expert_lora

        for layer in hf.moe_layers(model):
            attach_expert_lora(layer.experts, fcfg.lora_rank, fcfg.alpha, dtype=torch.float32)
    # the config of the adapter file, as stock PEFT would wrap the model (read at save time,
    # when PEFT's wrappers have renamed the attention projections)
    model.__dict__[_CONFIG] = lora_config(model, fcfg, base_path)
    config = lora_config(model, fcfg, base_path, experts=not own)
    if config.target_parameters is None and not config.target_modules:
        return model  # experts only, and they own their factors
    import peft

    with torch.random.fork_rng(devices=[]):  # PEFT's init draws: the run's RNG stays as it was
        wrapped = peft.get_peft_model(model, config)  # fp32 adapters (autocast_adapter_dtype)
    if own:  # PEFT froze every parameter but its own adapters
        from ...hf.lora.expert_lora import LORA_PARAMS

        for layer in hf.moe_layers(model):
            for name in LORA_PARAMS:
                getattr(layer.experts, name).requires_grad_(True)
    return wrapped


def _file_keys(model: nn.Module) -> dict[str, tuple]:
    """{trainable parameter name: (adapter-file key, expert layout or None)}, where the
    expert layout is ("A" | "B", num_experts) for the experts' own factors."""
    from ...hf.lora.expert_lora import expert_factor_keys, peft_paths

    inner = base_model(model)
    prefix = "base_model.model." if inner is not model else ""
    out: dict[str, tuple] = {}
    if any(hasattr(layer, "lora_A_first") for layer in inner.modules()):
        where = peft_paths(inner, inner.__dict__[_CONFIG])
        for name, (key, kind, E) in expert_factor_keys(inner, where).items():
            out[prefix + name] = (key, (kind, E))
    for name, p in model.named_parameters():
        if p.requires_grad and name not in out:
            out[name] = (name.replace(".default.", "."), None)  # PEFT drops the adapter name
    return out


def _global_region(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, its slice of the global tensor) for a plain or DTensor."""
    if not hasattr(t, "to_local"):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _initial(key: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """PEFT's default init of adapter-file tensor `key` (A: kaiming-uniform with a=sqrt(5),
    i.e. uniform in +-1/sqrt(in); B: zeros), drawn from a generator of (seed, key)."""
    if ".lora_B" in key:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    bound = 1.0 / shape[-1] ** 0.5
    return (torch.rand(shape, generator=g) * 2 - 1) * bound


def _peft_shape(kind: str, shape) -> tuple[int, int]:
    E, a, b = shape  # A [E, r, in] -> [E*r, in]; B [E, out, r] -> [out, r*E]
    return (E * a, b) if kind == "A" else (a, b * E)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Give every adapter its initial values (after loading the base: on the meta-device
    path the adapters are still empty), the same on one process and under any sharding."""
    from ...hf.lora.expert_lora import factor_from_peft

    params = dict(model.named_parameters())
    for name, (key, layout) in _file_keys(model).items():
        t = params[name]
        if layout is None:
            full = _initial(key, t.shape, seed)
        else:  # drawn in PEFT's layout, as the file holds it
            kind, E = layout
            full = factor_from_peft(kind, _initial(key, _peft_shape(kind, t.shape), seed), E)
        local, region = _global_region(t)
        local.copy_(full[region])


def save_adapter(model: nn.Module, out_dir: str | Path) -> Path:
    """The adapters in PEFT's format (adapter_config.json + adapter_model.safetensors) that
    `PeftModel.from_pretrained(stock_model, out_dir)` loads: `dropless.hf.save_lora_adapter`,
    the writer `dropless.parallelize`'s users call too. Every rank calls this; rank 0
    writes."""
    from ...hf.distributed.peft_save import save_lora_adapter

    return save_lora_adapter(model, out_dir)


def checkpoint_name(name: str) -> str | None:
    """The Transformers checkpoint key of model state key `name` (None: an adapter, not in
    the checkpoint): PEFT keeps a wrapped Linear's weight under `base_layer`."""
    leaf = name.rpartition(".")[2]
    if ".lora_" in name or leaf.startswith("lora_"):
        return None
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """The Transformers model with every adapter folded into its weights (one process)."""
    from ... import hf
    from ...hf.lora.expert_lora import LORA_PARAMS, fold_attached
    from ...hf.lora.peft_lora import raw_weight
    from ...ops import LowRank

    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    for layer in hf.moe_layers(model):
        m = layer.experts
        scale = m.__dict__.get("_dropless_lora_scale")
        if scale is None:
            continue
        names = ("gate_up_proj" if m.has_gate else "up_proj", "down_proj")
        for which, name in zip(("first", "down"), names):
            a, b = (getattr(m, f"lora_{k}_{which}").float() for k in "AB")
            w = raw_weight(m, name)  # folded in fp32, stored in the base's dtype
            w.copy_(fold_attached(w.float(), LowRank(a, b, scale), not m.is_transposed))
        for name in LORA_PARAMS:
            delattr(m, name)
        del m.__dict__["_dropless_lora_scale"]
    return model
