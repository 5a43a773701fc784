"""RMSNorm: everything about the op in one folder, and its entry point `rms_norm`: the
Triton kernels for CUDA tensors, the lean torch op everywhere else.

    y = rms_norm(x, weight, eps)                     # F.rms_norm(x, (D,), weight, eps)
    y, h = rms_norm(x, weight, eps, residual=r)      # normalises h = x + r, returns both

- `reference.py`: `rms_norm_reference`, the specification (torch's op);
- `eager.py`: the torch op with a lean backward (keeps x and one fp32 value per row);
- `rmsnorm_kernels.py`: the Triton kernels (fused residual add) and their autograd;
- the registry `RMSNORM` below: "torch" always, "triton" registered on the first call
  with a CUDA tensor. Calling on CPU imports no triton.
"""

# D normalised dim

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import Registry, cuda_with_triton, lazy
from .eager import rms_norm as torch_rms_norm

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class RMSNormImpl:
    """run(x, weight_D, eps, residual) as `rms_norm`; supports(x): whether it runs x."""

    name: str
    run: Callable
    supports: Callable[[torch.Tensor], bool]
    priority: int = 0


RMSNORM = Registry("rmsnorm backend")
RMSNORM.register(RMSNormImpl("torch", torch_rms_norm, supports=lambda x: True))


def register_gpu() -> None:
    """Register the Triton kernels as "triton" (the kernel module loads on first call)."""
    run = lazy("dropless.ops.rmsnorm.rmsnorm_kernels", "rms_norm")
    RMSNORM.register(RMSNormImpl("triton", run, supports=cuda_with_triton, priority=10))


RMSNORM.on_first_cuda(register_gpu)


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
    return RMSNORM.pick(backend, x).run(x, weight_D, eps, residual)


__all__ = ["BACKENDS", "RMSNORM", "RMSNormImpl", "rms_norm", "torch_rms_norm"]
