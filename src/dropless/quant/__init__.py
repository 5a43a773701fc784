"""FP8 and MXFP8 training: recipes, autocast, quantized grouped GEMMs, the fused
expert MLP step and FP8 saved activations.

    import dropless
    with dropless.autocast(recipe=dropless.MXFP8BlockScaling(fp8_saved_activations=True)):
        out, aux = moe(x)
    out.sum().backward()

Each recipe carries its quantized GEMM and MLP as methods; `autocast` makes it the
active recipe of `dropless.ops`, so every grouped-GEMM caller follows it.
"""

from __future__ import annotations

from .formats import (
    QTensor,
    cast_fp8,
    quantize_current,
    quantize_mx,
    quantize_mx_groups,
    quantize_scaled,
    scale_from_amax,
)
from .gemm import pick_backend, quantize_operand, quantized_grouped_gemm, torch_fp8_available
from .linear import Linear, convert_linear
from .mlp import quantized_grouped_mlp
from .recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    active_recipe,
    autocast,
    recipe_from_name,
)

__all__ = [
    "DelayedScaling",
    "Float8CurrentScaling",
    "Format",
    "Linear",
    "MXFP8BlockScaling",
    "QTensor",
    "active_recipe",
    "autocast",
    "cast_fp8",
    "convert_linear",
    "pick_backend",
    "quantize_current",
    "quantize_mx",
    "quantize_mx_groups",
    "quantize_operand",
    "quantize_scaled",
    "quantized_grouped_gemm",
    "quantized_grouped_mlp",
    "recipe_from_name",
    "scale_from_amax",
    "torch_fp8_available",
]
