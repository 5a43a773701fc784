"""RMSNorm: everything about the op in one folder, and its entry point `rms_norm`: the
Triton kernels for CUDA tensors, the lean torch op everywhere else.

    y = rms_norm(x, weight, eps)                     # F.rms_norm(x, (D,), weight, eps)
    y, h = rms_norm(x, weight, eps, residual=r)      # normalises h = x + r, returns both

- `reference.py`: `rms_norm_reference`, the specification (torch's op);
- `eager.py`: the torch passes (keep x and one fp32 value per row) and the op's one
  autograd Function, `RMSNormFunction`, which runs the passes the registry picks;
- `rmsnorm_kernels.py`: the Triton passes (fused residual add);
- `custom_op.py`: `dropless::rms_norm` and its backward, what an exported program and a
  compiled region on a GPU hold (the implementation is picked when the node runs); a
  compiled region on CPU traces the Function on the torch passes instead;
- `backends.py`: the registry `RMSNORM`: "torch" always; `gpu.py`: the "triton" entry,
  registered on the first pick for a CUDA tensor. Calling on CPU imports no triton.
"""

# D normalised dim

from __future__ import annotations

import torch

from . import custom_op
from .backends import RMSNORM, RMSNormImpl
from .eager import check_weight, rms_norm_bwd, rms_norm_fwd, rms_norm_with
from .eager import rms_norm as torch_rms_norm
from .gpu import register_gpu

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
    the torch op; a name the registry `RMSNORM` does not hold, or "triton" on a tensor it
    cannot run on, raises ValueError. Under `torch.compile`, "auto" on a CPU tensor is the
    one Function on the torch passes, traced (the compiler fuses its forward and its
    backward; an opaque node would run them one op at a time); on another device, and
    under `torch.export`, it is one `dropless::rms_norm` node (`custom_op.py`)."""
    if backend == "auto" and torch.compiler.is_compiling():
        check_weight(x, weight_D)
        if x.device.type == "cpu" and not torch.compiler.is_exporting():
            return rms_norm_with(rms_norm_fwd, rms_norm_bwd, x, weight_D, eps, residual)
        return custom_op.run(x, weight_D, eps, residual)
    impl = RMSNORM.pick(backend, x)
    return rms_norm_with(impl.forward, impl.backward, x, weight_D, eps, residual)


__all__ = ["RMSNORM", "RMSNormImpl", "register_gpu", "rms_norm", "torch_rms_norm"]
