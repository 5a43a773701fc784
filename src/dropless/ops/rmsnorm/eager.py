"""RMSNorm with a lean backward: the torch path of `dropless.ops.rmsnorm.rms_norm`
(every tensor the Triton kernel does not take, CPU included).

Kept for backward: the input and one fp32 reciprocal RMS per row; the normalised tensor
x_hat is recomputed from them in backward. Stock RMSNorm modules (and torch's
`F.rms_norm`, which decomposes into autograd nodes) also keep x_hat, a second tensor of
the input's size per norm; under activation checkpointing those are what a recomputed
layer holds until its backward.

`rms_norm_fwd` / `rms_norm_bwd` are the raw passes (no autograd), with the signatures of
the Triton kernel's (`rmsnorm_kernels.py`); `RMSNormFunction` runs whichever passes it is
given.

Semantics: `reference.rms_norm_reference` (torch's op): computed in fp32
(the input's dtype where wider), weight multiplied in that precision, cast to the
input's dtype.
"""

# R rows (every dim but the last), D normalised dim

from __future__ import annotations

import torch


def rms_norm_fwd(x, weight_D, eps: float, residual=None):
    """Raw forward (no autograd): (y, s, rstd). s is x + residual (x itself without a
    residual); rstd [...] (x's shape without its last dim) in fp32, or x's dtype where
    wider."""
    s = x if residual is None else x + residual
    sf = s.to(torch.promote_types(s.dtype, torch.float32))
    rstd = torch.rsqrt(sf.pow(2).mean(-1).add_(eps))
    y = (sf * rstd.unsqueeze(-1)).mul_(weight_D).to(s.dtype)
    return y, s, rstd


def rms_norm_bwd(gy, s, weight_D, rstd, gs=None, *, need_s: bool = True, need_w: bool = True):
    """Raw backward (no autograd): (ds, gw_D), None where not needed. ds is the gradient
    of s (so of x and of the residual); gs, the gradient reaching the residual-sum output,
    is added to it."""
    acc = rstd.dtype
    rstd_1 = rstd.unsqueeze(-1)
    x_hat = s.to(acc) * rstd_1
    gf = gy.to(acc)
    gw_D = None
    if need_w:
        gw_D = (gf * x_hat).reshape(-1, s.shape[-1]).sum(0).to(weight_D.dtype)
    ds = None
    if need_s:
        # d/ds of w * s * rstd: rstd * (g w - x_hat * mean(g w x_hat))
        gxh = gf * weight_D
        dot_1 = (gxh * x_hat).mean(-1, keepdim=True)
        ds = gxh.sub_(x_hat.mul_(dot_1)).mul_(rstd_1)
        ds = (ds if gs is None else ds.add_(gs)).to(s.dtype)
    return ds, gw_D


class RMSNormFunction(torch.autograd.Function):
    """The one autograd Function of RMSNorm: the raw passes it is given (the torch ones of
    this file, or the Triton kernels' for a CUDA tensor) forward and backward, on x [..., D]
    with an optional residual (`(y, x + residual)` out). Kept for backward: x + residual
    (x itself without one) and one fp32 value per row."""

    @staticmethod
    def forward(ctx, x, weight_D, residual, eps: float, fwd, bwd):
        y, s, rstd = fwd(x, weight_D, eps, residual)
        ctx.save_for_backward(s, weight_D, rstd)
        ctx.bwd, ctx.has_res = bwd, residual is not None
        return (y, s) if ctx.has_res else y

    @staticmethod
    def backward(ctx, gy, gs=None):
        s, weight_D, rstd = ctx.saved_tensors
        need_x, need_w, need_r = ctx.needs_input_grad[:3]
        ds, gw_D = ctx.bwd(gy.contiguous(), s, weight_D, rstd, gs if ctx.has_res else None)
        return ds if need_x else None, gw_D if need_w else None, ds if need_r else None, \
            None, None, None  # fmt: skip


def rms_norm_with(fwd, bwd, x, weight_D, eps: float = 1e-6, residual=None):
    """RMSNorm of x (of x + residual, returning `(y, x + residual)`) with autograd, through
    the raw passes `fwd` / `bwd` (`rms_norm_fwd` / `rms_norm_bwd`'s signatures)."""
    check_weight(x, weight_D)
    return RMSNormFunction.apply(x, weight_D, residual, float(eps), fwd, bwd)


def check_weight(x: torch.Tensor, weight_D: torch.Tensor) -> None:
    """ValueError unless weight_D is a vector of x's last dim."""
    if weight_D.dim() != 1 or weight_D.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight of shape {tuple(weight_D.shape)} does not match the last dim "
            f"of x {tuple(x.shape)}; expected a vector of {x.shape[-1]}"
        )


def rms_norm(
    x: torch.Tensor,
    weight_D: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
):
    """RMSNorm over the last dim of x, times `weight_D` ([D]), keeping only x and one
    fp32 value per row for backward. With `residual`: of `x + residual`, returning
    `(normed, x + residual)` (the Triton kernel's signature)."""
    return rms_norm_with(rms_norm_fwd, rms_norm_bwd, x, weight_D, eps, residual)
