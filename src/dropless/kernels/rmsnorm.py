"""RMSNorm entry point: the Triton kernels for CUDA tensors, the lean torch op
(`dropless.ops.rmsnorm`: keeps x and one fp32 value per row for backward) everywhere else.

    y = rms_norm(x, weight, eps)                     # F.rms_norm(x, (D,), weight, eps)
    y, h = rms_norm(x, weight, eps, residual=r)      # normalises h = x + r, returns both

Importing this module does not import Triton; the kernel module loads on the first CUDA
call. Semantics: `dropless.ops.reference.rms_norm_reference`.
"""

# D normalised dim

from __future__ import annotations

import torch

from ..ops.rmsnorm import rms_norm as torch_rms_norm
from . import available

BACKENDS = ("auto", "torch", "triton")


def rms_norm(
    x: torch.Tensor,
    weight_D: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    *,
    backend: str = "auto",
):
    """RMSNorm over the last dim of x (of `x + residual` when given, returning
    `(normed, x + residual)`). backend "auto": Triton on CUDA with triton installed, else
    the torch op; "triton" on a tensor it cannot run on raises ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    use_triton = backend == "triton" or (backend == "auto" and available(x))
    if use_triton:
        if not available(x):
            raise ValueError(
                f"backend='triton' needs a CUDA tensor and triton (pip install "
                f"'dropless[triton]'); got a {x.device.type} tensor; use backend='auto'"
            )
        from .rmsnorm_kernels import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight_D, eps, residual)
    return torch_rms_norm(x, weight_D, eps, residual)
