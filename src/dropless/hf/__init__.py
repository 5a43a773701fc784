"""Hugging Face Transformers v5 integration: one line makes stock MoE models use dropless.

    import dropless
    dropless.patch()                                   # models built/loaded afterwards
    model = AutoModelForCausalLM.from_pretrained(path) # ... run their experts via dropless
    dropless.patch_model(model, expert_bias=True)      # or switch a model already built
    dropless.hf.save_hf(model, "out")                  # stock-loadable checkpoint
    dropless.unpatch()                                 # stock behaviour, exactly

Transformers itself is imported on first use; install it with `pip install 'dropless[hf]'`.
"""

from ._compat import SUPPORTED_RANGE, check_version
from .experts import (
    CALLS,
    SUPPORTED_FAMILIES,
    DroplessFallbackWarning,
    ExpertsSpec,
    dropless_experts_forward,
    experts_spec,
)
from .layers import MoELayer, added_state_keys, moe_layers, save_hf, tokens_per_expert
from .patching import IMPLEMENTATION, is_patched, patch, patch_model, unpatch, unpatch_model
from .router_losses import RouterLosses, RouterStats

__all__ = [
    "CALLS",
    "IMPLEMENTATION",
    "SUPPORTED_FAMILIES",
    "SUPPORTED_RANGE",
    "DroplessFallbackWarning",
    "ExpertsSpec",
    "MoELayer",
    "RouterLosses",
    "RouterStats",
    "added_state_keys",
    "check_version",
    "dropless_experts_forward",
    "experts_spec",
    "is_patched",
    "moe_layers",
    "patch",
    "patch_model",
    "save_hf",
    "tokens_per_expert",
    "unpatch",
    "unpatch_model",
]
