"""The "triton" row ops: the gathers of permute / combine (`permute_kernels.py`), the
gated activations x prob (`activation/swiglu_kernels.py`) and the zeroing of empty
groups (`grouped_gemm/group_kernels.py`) as one `RowOps`, registered by `register_gpu`
on the first pick for a CUDA tensor. Building it imports no triton: each kernel module
loads on its first call."""

# T tokens, S sorted pairs, N features, K top-k

from __future__ import annotations

import torch

from ..registry import lazy, triton_importable
from .row_ops import RowOps, register_row_ops

_PERMUTE = "dropless.ops.permute.permute_kernels"
_SWIGLU = "dropless.ops.activation.swiglu_kernels"
_GROUPS = "dropless.ops.grouped_gemm.group_kernels"
_ROW_OPS: list[RowOps] = []


def _supports(t: torch.Tensor) -> bool:
    return (
        t.is_cuda
        and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and triton_importable()
    )


def triton_row_ops() -> RowOps:
    """The Triton kernels as a `RowOps` ("triton", built once)."""
    if not _ROW_OPS:
        _ROW_OPS.append(
            RowOps(
                "triton",
                lazy(_PERMUTE, "gather_rows"),
                lazy(_PERMUTE, "gather_sum"),
                lazy(_PERMUTE, "pair_dot"),
                lazy(_SWIGLU, "swiglu_fwd"),
                lazy(_SWIGLU, "swiglu_bwd"),
                # the kinds `activation.swiglu` hands to row ops; the kernels compute
                # every gated kind of `activation_kernels.KINDS`
                ("swiglu", "gpt_oss"),
                supports=_supports,
                priority=10,
                zero_groups=lazy(_GROUPS, "zero_groups"),
            )
        )
    return _ROW_OPS[0]


def register_gpu() -> None:
    """Register the "triton" row ops."""
    register_row_ops(triton_row_ops())
