"""The expert path of a patched Transformers model: `forward.py` (the "dropless" experts
implementation, `experts_spec`, the path counters, `register_experts_hook`), `gates.py`
(the probe of a gate's fused form), `replay.py` (routing replay on a model's routers),
`router_losses.py` (`RouterLosses`). The names of `forward.py` are re-exported here; the
other files are imported by their own module.
"""

from .forward import (
    CALLS,
    PATH_CALLS,
    DroplessFallbackWarning,
    DroplessGenericGateWarning,
    ExpertsSpec,
    dropless_experts_forward,
    experts_spec,
    module_spec,
    register_experts_hook,
    wire_experts,
)

__all__ = [
    "CALLS",
    "PATH_CALLS",
    "DroplessFallbackWarning",
    "DroplessGenericGateWarning",
    "ExpertsSpec",
    "dropless_experts_forward",
    "experts_spec",
    "module_spec",
    "register_experts_hook",
    "wire_experts",
]
