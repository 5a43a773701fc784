"""Grouped GEMM, y[s] = x[s] @ w[e(s)]^T over contiguous groups of rows: the reference
(`reference.py`), the backend registry (`backends.py`), the autograd Function with the
"loop" and "grouped_mm" backends (`eager.py`), the Triton kernels (`gemm_kernels.py`,
`group_kernels.py`) registered as "triton" on the first CUDA pick (`gpu.py`), the custom
op a compiled region holds (`custom_op.py`), and the entry `grouped_gemm` below.
"""

# S rows (sorted pairs), D in features, N out features, E groups (experts)

from __future__ import annotations

import torch

from ..compute_dtype import autocast_dtype
from ..dispatch import get_recipe, recipe_gemm
from ..weight_cache import cached_cast
from . import custom_op
from .backends import (
    GEMM_BACKENDS,
    GemmBackend,
    gemm_backends,
    pick_gemm_backend,
    register_gemm_backend,
)
from .eager import GroupedGemm, aligned_dims, bind_offsets, check_counts, group_offsets
from .gpu import register_gpu

GEMM_BACKENDS.on_first_cuda(register_gpu)


def grouped_gemm(
    x_SD: torch.Tensor,
    w: torch.Tensor,
    counts,
    bias_EN: torch.Tensor | None = None,
    *,
    trans_w: bool = True,
    backend: str | None = None,
    offsets_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[s] = x[s] @ w[e(s)]^T (+ bias[e(s)]) over contiguous groups of `counts` rows.

    w is [E, N, D] (out, in: the nn.Linear and Transformers v5 layout) when trans_w,
    else [E, D, N]. counts: list of ints or 1-D integer tensor (read on the host once).
    offsets_E: their int32 cumulative ends on x's device when the caller has them
    (`SortedPairs.offsets_E`: a layer's GEMMs then share one tensor), else None.
    Under `dropless.autocast(recipe=...)` the recipe's quantized GEMM runs instead; under
    a compiler with tensor counts the call is one `dropless::grouped_gemm` node.
    """
    compiled = torch.compiler.is_compiling() and isinstance(counts, torch.Tensor)
    # torch.compile / export: one node (a recipe or a named backend keeps the eager path)
    if compiled and offsets_E is None and backend in (None, "auto") and get_recipe() is None:
        return custom_op.run(x_SD, w, counts, bias_EN, trans_w)
    counts = check_counts(x_SD, w, counts)
    recipe = get_recipe()
    if recipe is not None:
        return recipe_gemm(recipe)(x_SD, w, counts, bias_EN, trans_w)
    dt = autocast_dtype(x_SD, w, bias_EN)
    if dt is not None:  # the autocast dtype, weights cast once per step (compute_dtype.py)
        x_SD, w = x_SD.to(dt), cached_cast(w, dt)
        bias_EN = None if bias_EN is None else cached_cast(bias_EN, dt)
    return GroupedGemm.apply(x_SD, w, bias_EN, counts, offsets_E, trans_w, backend)


__all__ = [
    "GEMM_BACKENDS",
    "GemmBackend",
    "aligned_dims",
    "bind_offsets",
    "gemm_backends",
    "group_offsets",
    "grouped_gemm",
    "pick_gemm_backend",
    "register_gemm_backend",
]
