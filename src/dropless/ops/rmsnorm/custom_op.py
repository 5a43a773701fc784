"""RMSNorm as PyTorch custom ops (`dropless::rms_norm` and its backward): what
`torch.compile` and `torch.export` see of `rms_norm` (backend "auto").

A compiled region holds one node per norm: the node picks its implementation when it
runs (the Triton kernels for a CUDA tensor, registered then if this is the process's
first CUDA norm; the torch passes elsewhere), so a process whose first norm is compiled
still runs the kernels, and Dynamo never traces the registry. The fake rules give the
shapes from the operands.

The forward node returns (y_RD, s_RD, rstd_R): s = x + residual is the next residual
stream (an empty tensor without a residual: a custom op's output may not alias its
input, and backward then takes x itself), rstd_R the per-row statistic the backward
node takes.
"""

# R rows, D normalised dim

from __future__ import annotations

import torch
from torch import Tensor

from .backends import RMSNORM


def _impl(x: Tensor):
    return RMSNORM.pick("auto", x)


def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


@torch.library.custom_op("dropless::rms_norm", mutates_args=())
def rms_norm_op(
    x_RD: Tensor, weight_D: Tensor, residual_RD: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(y_RD, s_RD, rstd_R): the norm of x (+ residual), the sum (empty without a
    residual) and the reciprocal RMS per row."""
    y, s, rstd = _impl(x_RD).forward(x_RD, weight_D, eps, residual_RD)
    s = s if residual_RD is not None else x_RD.new_empty(0)
    return y, s, rstd.to(_stat_dtype(x_RD))


@rms_norm_op.register_fake
def _(x_RD, weight_D, residual_RD, eps):
    s = torch.empty_like(x_RD) if residual_RD is not None else x_RD.new_empty(0)
    return torch.empty_like(x_RD), s, x_RD.new_empty(x_RD.shape[0], dtype=_stat_dtype(x_RD))


@torch.library.custom_op("dropless::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    gy_RD: Tensor, gs_RD: Tensor | None, s_RD: Tensor, weight_D: Tensor, rstd_R: Tensor
) -> tuple[Tensor, Tensor]:
    """(ds_RD, gw_D): the gradient of x + residual (gs_RD, the gradient reaching the sum
    output, added) and of the weight."""
    ds, gw = _impl(s_RD).backward(gy_RD, s_RD, weight_D, rstd_R.to(_stat_dtype(s_RD)), gs_RD)
    return ds, gw


@rms_norm_backward_op.register_fake
def _(gy_RD, gs_RD, s_RD, weight_D, rstd_R):
    return torch.empty_like(s_RD), torch.empty_like(weight_D)


def _setup_context(ctx, inputs, output):
    x_RD, weight_D, residual_RD, _eps = inputs
    _y, s_RD, rstd_R = output
    ctx.has_res = residual_RD is not None
    ctx.save_for_backward(s_RD if ctx.has_res else x_RD, weight_D, rstd_R)
    ctx.mark_non_differentiable(rstd_R)


def _backward(ctx, gy_RD, gs_RD, _g_rstd):
    s_RD, weight_D, rstd_R = ctx.saved_tensors
    gs = gs_RD if ctx.has_res else None
    ds, gw = rms_norm_backward_op(gy_RD.contiguous(), gs, s_RD, weight_D, rstd_R)
    n = ctx.needs_input_grad
    return (ds if n[0] else None, gw if n[1] else None, ds if ctx.has_res and n[2] else None,
            None)  # fmt: skip


torch.library.register_autograd("dropless::rms_norm", _backward, setup_context=_setup_context)


def run(x: Tensor, weight_D: Tensor, eps: float, residual: Tensor | None):
    """`rms_norm` through the custom ops: y, or (y, x + residual)."""
    D = x.shape[-1]
    r_RD = residual.reshape(-1, D) if residual is not None else None
    y_RD, s_RD, _ = rms_norm_op(x.reshape(-1, D), weight_D, r_RD, float(eps))
    if residual is None:
        return y_RD.view(x.shape)
    return y_RD.view(x.shape), s_RD.view(x.shape)
