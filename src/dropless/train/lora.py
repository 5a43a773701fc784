"""LoRA fine-tuning in `dropless train` (`finetune.method = "lora"`).

The checkpoint of `model.path` is loaded, switched to the dropless experts path, then
wrapped by stock PEFT (`get_peft_model`): LoRA on the fused expert weights through
`target_parameters` (run by dropless as thin grouped GEMMs, see `dropless.hf.lora`) and
on the attention projections through `target_modules`. The base stays frozen; only the
adapters reach the optimizer and the checkpoints (`trainable_only`), and the run ends
with the adapter in PEFT's own format in `RUN/adapter` (`PeftModel.from_pretrained`
loads it on the stock model). `dropless convert RUN OUT --merge` folds it into the
weights and writes a stock Transformers directory.
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

ADAPTER_DIR = "adapter"
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
    from .. import hf

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


def apply_lora(model: nn.Module, fcfg, base_path: str = ""):
    """Wrap `model` (already patched) in a PeftModel with LoRA on `fcfg.lora_targets`."""
    peft = require_peft()
    params, modules = lora_targets(model, list(fcfg.lora_targets))
    config = peft.LoraConfig(
        r=fcfg.lora_rank,
        lora_alpha=fcfg.alpha,
        target_parameters=params or None,
        target_modules=modules if modules is not None else [],
        base_model_name_or_path=base_path or None,
    )
    return peft.get_peft_model(model, config)


def save_adapter(model, out_dir: str | Path) -> Path:
    """The adapter of a PeftModel in PEFT's format (adapter_config.json + safetensors)."""
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
