"""FP8 and MXFP8 training: recipes, autocast, quantized grouped GEMMs, the fused
GroupedMLP step and FP8 saved activations.

    import dropless
    with dropless.autocast(recipe=dropless.MXFP8BlockScaling(fp8_saved_activations=True)):
        out, aux = moe(x)
    out.sum().backward()

Importing this package registers its GEMM and MLP for each recipe kind in
`dropless.ops.dispatch`, so every grouped-GEMM caller follows the active recipe.
"""

from __future__ import annotations

from ..ops.dispatch import register_recipe_gemm, register_recipe_mlp
from .formats import (
    FP8_MAX,
    QTensor,
    cast_fp8,
    mx_exponent,
    quantize_current,
    quantize_mx,
    quantize_mx_groups,
    quantize_scaled,
    scale_from_amax,
)
from .gemm import pick_backend, quantize_operand, quantized_grouped_gemm, torch_fp8_available
from .linear import Linear, convert_linear
from .mlp import quantized_grouped_mlp, swiglu_quant
from .recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    active_recipe,
    autocast,
    recipe_from_name,
)

for _kind in ("delayed", "current", "mxfp8"):
    register_recipe_gemm(_kind, quantized_grouped_gemm)
    register_recipe_mlp(_kind, quantized_grouped_mlp)

__all__ = [
    "FP8_MAX",
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
    "mx_exponent",
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
    "swiglu_quant",
    "torch_fp8_available",
]
