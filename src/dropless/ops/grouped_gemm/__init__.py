"""Grouped GEMM, y[s] = x[s] @ w[e(s)]^T over contiguous groups of rows: everything about
the op in one folder.

- `reference.py`: `grouped_gemm_reference`, the specification (a loop over groups);
- `backends.py`: `GemmBackend` and the registry `GEMM_BACKENDS` of raw grouped products;
- `eager.py`: `grouped_gemm` with its autograd Function, the "loop" and "grouped_mm"
  (`torch._grouped_mm`) backends and `bind_offsets`;
- `gemm_kernels.py`: the Triton grouped GEMM and weight gradient; `group_kernels.py`:
  the zeroing of empty groups' weight-gradient blocks (a "triton" row op);
- `gpu.py`: the "triton" backend, registered on the first pick for a CUDA operand;
- `custom_op.py`: `dropless::grouped_gemm` and its backward, what a compiled region or an
  exported program holds of a call with tensor counts.
"""

from .backends import (
    GEMM_BACKENDS,
    GemmBackend,
    gemm_backends,
    pick_gemm_backend,
    register_gemm_backend,
)
from .eager import aligned_dims, bind_offsets, group_offsets, grouped_gemm
from .gpu import register_gpu

GEMM_BACKENDS.on_first_cuda(register_gpu)

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
