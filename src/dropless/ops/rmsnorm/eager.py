"""RMSNorm with a lean backward: the torch path of `dropless.ops.rmsnorm.rms_norm`
(every tensor the Triton kernel does not take, CPU included).

Kept for backward: the input and one fp32 reciprocal RMS per row; the normalised tensor
x_hat is recomputed from them in backward. Stock RMSNorm modules (and torch's
`F.rms_norm`, which decomposes into autograd nodes) also keep x_hat, a second tensor of
the input's size per norm; under activation checkpointing those are what a recomputed
layer holds until its backward.

Semantics: `reference.rms_norm_reference` (torch's op): computed in fp32
(the input's dtype where wider), weight multiplied in that precision, cast to the
input's dtype.
"""

# R rows (every dim but the last), D normalised dim

from __future__ import annotations

import torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_D, eps: float):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd_R1 = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        y = (xf * rstd_R1).mul_(weight_D).to(x.dtype)
        ctx.save_for_backward(x, weight_D, rstd_R1)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight_D, rstd_R1 = ctx.saved_tensors
        acc = rstd_R1.dtype
        x_hat = x.to(acc) * rstd_R1
        gf = g.to(acc)
        gw_D = None
        if ctx.needs_input_grad[1]:
            gw_D = (gf * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight_D.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            # d/dx of w * x * rstd: rstd * (g w - x_hat * mean(g w x_hat))
            gxh = gf * weight_D
            dot_R1 = (gxh * x_hat).mean(-1, keepdim=True)
            gx = gxh.sub_(x_hat.mul_(dot_R1)).mul_(rstd_R1).to(x.dtype)
        return gx, gw_D, None


def rms_norm(
    x: torch.Tensor,
    weight_D: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
):
    """RMSNorm over the last dim of x, times `weight_D` ([D]), keeping only x and one
    fp32 value per row for backward. With `residual`: of `x + residual`, returning
    `(normed, x + residual)` (the Triton kernel's signature)."""
    if weight_D.dim() != 1 or weight_D.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight of shape {tuple(weight_D.shape)} does not match the last dim "
            f"of x {tuple(x.shape)}; expected a vector of {x.shape[-1]}"
        )
    s = x if residual is None else x + residual
    y = _RMSNorm.apply(s, weight_D, float(eps))
    return y if residual is None else (y, s)
