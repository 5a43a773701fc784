"""The "triton" cross-entropy row op (`cross_entropy_kernels.py`), registered by
`register_gpu` on the first pick for a CUDA tensor. Registering imports no triton: the
kernel module loads on the first call."""

from __future__ import annotations

import torch

from ..registry import lazy, triton_importable
from .rows import CERows, register_ce_rows


def _supports(t: torch.Tensor) -> bool:
    return (
        t.is_cuda
        and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and triton_importable()
    )


def register_gpu() -> None:
    """Register the Triton row op as "triton"."""
    run = lazy("dropless.ops.linear_cross_entropy.cross_entropy_kernels", "ce_rows")
    register_ce_rows(CERows("triton", run, supports=_supports, priority=10))
