"""dropless: dropless Mixture-of-Experts training for PyTorch.

    import dropless
    moe = dropless.MoE(hidden_size=512, moe_intermediate_size=256, num_experts=8, top_k=2)
    out, aux = moe(x)

    dropless.patch()                      # Hugging Face v5 MoE models use our experts path
    with dropless.autocast(recipe=dropless.MXFP8BlockScaling()):
        ...                               # expert GEMMs in MXFP8

Optional parts (transformers, quantization recipes) are imported on first use.
"""

from __future__ import annotations

import importlib

from . import kernels as _kernels  # noqa: F401  (registers the Triton grouped-GEMM backend)
from .nn import GroupedExperts, GroupedLinear, LocalDispatcher, MoE, MoEAux, TopKRouter
from .ops.specs import ActivationConfig, RoutingConfig

__version__ = "0.1.0"

# name -> module that defines it, imported on first access so `import dropless`
# stays light and works without transformers installed.
_LAZY = {
    "patch": "dropless.hf",
    "patch_model": "dropless.hf",
    "unpatch": "dropless.hf",
    "autocast": "dropless.quant",
    "DelayedScaling": "dropless.quant",
    "Float8CurrentScaling": "dropless.quant",
    "MXFP8BlockScaling": "dropless.quant",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dropless' has no attribute {name!r}")


__all__ = [
    "ActivationConfig",
    "GroupedExperts",
    "GroupedLinear",
    "LocalDispatcher",
    "MoE",
    "MoEAux",
    "RoutingConfig",
    "TopKRouter",
    "__version__",
    *_LAZY,
]
