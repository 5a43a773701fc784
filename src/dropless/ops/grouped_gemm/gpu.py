"""The "triton" grouped-GEMM backend (`gemm_kernels.py`), registered by `register_gpu`
on the first pick for a CUDA operand. Registering imports no triton: the kernel module
loads on the first call."""

# S rows, E groups

from __future__ import annotations

import torch

from ..registry import lazy, triton_importable
from .backends import GemmBackend, register_gemm_backend

# below torch._grouped_mm ("grouped_mm", 10) where that runs, above the per-expert loop
TRITON_PRIORITY = 5
_KERNELS = "dropless.ops.grouped_gemm.gemm_kernels"


def supports_triton_gemm(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.is_cuda
        and b.is_cuda
        and a.dtype == b.dtype
        and a.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and a.dim() == 2
        and b.dim() == 3
        and triton_importable()
    )


def register_gpu() -> None:
    """Register the Triton grouped GEMM (counts read on the device: no host sync)."""
    register_gemm_backend(
        GemmBackend(
            "triton",
            lazy(_KERNELS, "grouped_mm"),
            lazy(_KERNELS, "grouped_wgrad"),
            supports=supports_triton_gemm,
            priority=TRITON_PRIORITY,
            device_counts=True,
        )
    )
