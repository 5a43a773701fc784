"""The registry of RMSNorm implementations: "torch" (`eager.py`) always, "triton"
(`rmsnorm_kernels.py`) registered on the first pick for a CUDA tensor (registering
imports no triton: the kernel module loads on its first call)."""

# D normalised dim

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import Registry, cuda_with_triton, lazy
from .eager import rms_norm_bwd, rms_norm_fwd


@dataclass(frozen=True)
class RMSNormImpl:
    """supports(x): whether it runs x; forward / backward: its raw passes
    (`eager.rms_norm_fwd` and `rms_norm_bwd`'s signatures, on [..., D]), which the one
    autograd Function (`eager.RMSNormFunction`) and the custom op run."""

    name: str
    supports: Callable[[torch.Tensor], bool]
    forward: Callable
    backward: Callable
    priority: int = 0


RMSNORM = Registry("rmsnorm backend")
RMSNORM.register(RMSNormImpl("torch", lambda x: True, rms_norm_fwd, rms_norm_bwd))


def register_gpu() -> None:
    """Register the Triton kernels as "triton" (the kernel module loads on first call)."""
    kernels = "dropless.ops.rmsnorm.rmsnorm_kernels"
    fwd, bwd = (lazy(kernels, f) for f in ("rms_norm_fwd", "rms_norm_bwd"))
    RMSNORM.register(RMSNormImpl("triton", cuda_with_triton, fwd, bwd, priority=10))


RMSNORM.on_first_cuda(register_gpu)
