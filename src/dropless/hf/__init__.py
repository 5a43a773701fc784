"""Hugging Face Transformers v5 integration: one line makes stock MoE models use dropless.

    import dropless
    report = dropless.patch()                          # models built/loaded afterwards
    model = AutoModelForCausalLM.from_pretrained(path) # ... run their experts via dropless
    print(report)                                      # which modules run which path
    dropless.patch_model(model, expert_bias=True)      # or switch a model already built
    dropless.hf.save_hf(model, "out")                  # stock-loadable checkpoint
    dropless.unpatch()                                 # stock behaviour, exactly

Every experts class decorated with Transformers' `@use_experts_implementation` is
covered; what a module computes decides the path (`experts_spec`, `discovery.coverage`).
Transformers itself is imported on first use; install it with `pip install 'dropless[hf]'`.
"""

from ._compat import SUPPORTED_RANGE, check_version
from .experts import (
    CALLS,
    PATH_CALLS,
    DroplessFallbackWarning,
    DroplessGenericGateWarning,
    ExpertsSpec,
    dropless_experts_forward,
    experts_spec,
    register_experts_hook,
)
from .layers import MoELayer, added_state_keys, moe_layers, save_hf, tokens_per_expert
from .lora import DroplessLoRAFallbackWarning
from .patching import (
    IMPLEMENTATION,
    is_patched,
    patch,
    patch_model,
    report,
    unpatch,
    unpatch_model,
)
from .replay import has_routing_replay, install_routing_replay, remove_routing_replay
from .report import ModelRecord, ModuleRecord, PatchReport
from .rmsnorm import disable_fused_rmsnorm, enable_fused_rmsnorm
from .router_losses import RouterLosses, RouterStats

__all__ = [
    "CALLS",
    "IMPLEMENTATION",
    "PATH_CALLS",
    "SUPPORTED_RANGE",
    "DroplessFallbackWarning",
    "DroplessGenericGateWarning",
    "DroplessLoRAFallbackWarning",
    "ExpertsSpec",
    "MoELayer",
    "ModelRecord",
    "ModuleRecord",
    "PatchReport",
    "RouterLosses",
    "RouterStats",
    "added_state_keys",
    "check_version",
    "disable_fused_rmsnorm",
    "dropless_experts_forward",
    "enable_fused_rmsnorm",
    "experts_spec",
    "has_routing_replay",
    "install_routing_replay",
    "is_patched",
    "moe_layers",
    "patch",
    "patch_model",
    "register_experts_hook",
    "remove_routing_replay",
    "report",
    "save_hf",
    "tokens_per_expert",
    "unpatch",
    "unpatch_model",
]
