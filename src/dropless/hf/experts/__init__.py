"""The expert path of a patched Transformers model, one file per part:

- `forward.py`: `dropless_experts_forward`, the "dropless" experts implementation;
  `experts_spec` / `ExpertsSpec`, what a module computes, and `module_spec`, the same
  kept on the module (computed when a model is wired, `wire_experts`); the path counters `CALLS` and `PATH_CALLS`; `register_experts_hook`;
- `gates.py`: the float64 probe that finds the fused form of a module's gate;
- `replay.py`: routing replay on the routers of a model (hooks `patch()` installs);
- `router_losses.py`: `RouterLosses`, the aux and z losses and the per-expert counts of
  what a forward computed.

The names of `forward.py` below are re-exported here, so `dropless.hf.experts.CALLS`,
`dropless.hf.experts.experts_spec` and the others read the same objects. This file
imports `forward.py` only: the other files of the folder and the modules outside it
that need them import them by their own module.
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
