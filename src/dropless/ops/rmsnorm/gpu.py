"""The "triton" RMSNorm passes (`rmsnorm_kernels.py`) as an `RMSNormImpl` entry,
registered by `register_gpu` on the first pick for a CUDA tensor. Registering imports no
triton: the kernel module loads on the first call."""

from __future__ import annotations

from ..registry import cuda_with_triton, lazy
from .backends import RMSNORM, RMSNormImpl

_KERNELS = "dropless.ops.rmsnorm.rmsnorm_kernels"


def register_gpu() -> None:
    """Register the Triton kernels as "triton"."""
    fwd, bwd = (lazy(_KERNELS, f) for f in ("rms_norm_fwd", "rms_norm_bwd"))
    RMSNORM.register(RMSNormImpl("triton", cuda_with_triton, fwd, bwd, priority=10))
