"""dropless: dropless Mixture-of-Experts training for PyTorch.

    import dropless
    moe = dropless.MoE(hidden_size=512, moe_intermediate_size=256, num_experts=8, top_k=2)
    out, aux = moe(x)

    dropless.patch()                      # Hugging Face v5 MoE models use our experts path
    dropless.parallelize(model, ep=8)     # under torchrun: expert parallelism and FSDP2
    with dropless.autocast(recipe=dropless.MXFP8BlockScaling()):
        ...                               # expert GEMMs in MXFP8

Every name and subpackage is imported on first use, so `import dropless` (and the
command line's argument parsing, `dropless --help`) does not import torch; optional
parts (transformers, quantization recipes) load only when asked for.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it, imported on first access
_LAZY = {
    "ActivationConfig": "dropless.ops.specs",
    "RoutingConfig": "dropless.ops.specs",
    "GroupedExperts": "dropless.nn",
    "GroupedLinear": "dropless.nn",
    "LocalDispatcher": "dropless.nn",
    "MoE": "dropless.nn",
    "MoEAux": "dropless.nn",
    "TopKRouter": "dropless.nn",
    "patch": "dropless.hf",
    "patch_model": "dropless.hf",
    "unpatch": "dropless.hf",
    "parallelize": "dropless.hf",
    "autocast": "dropless.quant",
    "DelayedScaling": "dropless.quant",
    "Float8CurrentScaling": "dropless.quant",
    "MXFP8BlockScaling": "dropless.quant",
}
_SUBPACKAGES = ("bench", "cli", "hf", "jax", "nn", "ops", "parallel", "quant", "train")


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:  # `dropless.nn.MoE` after a bare `import dropless`
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'dropless' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBPACKAGES})


__all__ = ["__version__", *_LAZY]
