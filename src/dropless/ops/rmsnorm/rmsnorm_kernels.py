"""RMSNorm with an optional fused residual add, forward and backward, on CUDA.

Algorithm. Row r of x_RD (plus residual_RD when given: s = x + residual, the new
residual stream, is written out too) is normalised with fp32 accumulation:

    rstd[r] = 1 / sqrt(mean_d s[r, d]^2 + eps)
    y[r, d] = s[r, d] * rstd[r] * w[d]

Backward, with n = s * rstd and gy the gradient of y (gs that of the residual output):

    ds[r, d] = rstd[r] * (gy * w - n * mean_d(gy * w * n)) + gs
    gw[d]    = sum_r gy[r, d] * n[r, d]

dx = dresidual = ds. One program per tile of rows walks the D columns in tiles twice
(the row statistic, then the elementwise pass), so any D fits. The weight gradient is
summed per program into a [programs, D] fp32 buffer and reduced by torch afterwards:
a fixed order, no atomics, deterministic. Only s (or x) and rstd [R] are saved.
Math is fp32; outputs are in x's dtype. Semantics equal `torch.nn.functional.rms_norm`
on `x + residual` (`reference.rms_norm_reference`), which is also the path
for CPU tensors.
"""

# R rows (tokens), D normalised dim, P programs (row tiles)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import check_2d, row_blocks


@triton.jit
def rmsnorm_fwd_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr, R, D, eps,
    HAS_RES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    rows = offs_r.to(tl.int64)[:, None] * D
    sumsq = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = mask_r[:, None] & (offs_d < D)[None, :]
        s = tl.load(x_ptr + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            s += tl.load(r_ptr + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            s = s.to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + rows + offs_d[None, :], s, mask=mask)
            s = s.to(tl.float32)  # the statistic of the sum as stored, like x + residual
        sumsq += tl.sum(s * s, axis=1)
    rstd = 1.0 / tl.sqrt(sumsq / D + eps)
    tl.store(rstd_ptr + offs_r, rstd, mask=mask_r)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        mask = mask_r[:, None] & mask_d[None, :]
        # the summed row as stored (in x's dtype), as the unfused x + residual gives it
        src = s_ptr if HAS_RES else x_ptr
        s = tl.load(src + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        y = s * rstd[:, None] * w[None, :]
        tl.store(y_ptr + rows + offs_d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rmsnorm_bwd_kernel(
    gy_ptr, gs_ptr, s_ptr, w_ptr, rstd_ptr, ds_ptr, gw_ptr, R, D,
    HAS_GS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    rows = offs_r.to(tl.int64)[:, None] * D
    rstd = tl.load(rstd_ptr + offs_r, mask=mask_r, other=0.0)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        mask = mask_r[:, None] & mask_d[None, :]
        gy = tl.load(gy_ptr + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        dot += tl.sum(gy * w[None, :] * s, axis=1)
    mean_dot = dot * rstd / D  # mean_d(gy * w * n)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        mask = mask_r[:, None] & mask_d[None, :]
        gy = tl.load(gy_ptr + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        n = s * rstd[:, None]
        ds = rstd[:, None] * (gy * w[None, :] - n * mean_dot[:, None])
        if HAS_GS:
            ds += tl.load(gs_ptr + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(ds_ptr + rows + offs_d[None, :], ds.to(ds_ptr.dtype.element_ty), mask=mask)
        tl.store(gw_ptr + pid * D + offs_d, tl.sum(gy * n, axis=0), mask=mask_d)


def _check(x_RD: torch.Tensor, weight_D: torch.Tensor, residual_RD: torch.Tensor | None) -> None:
    check_2d("x", x_RD)
    if weight_D.shape != (x_RD.shape[1],):
        raise ValueError(f"weight must be [D] = [{x_RD.shape[1]}], got {tuple(weight_D.shape)}")
    if residual_RD is not None and (
        residual_RD.shape != x_RD.shape or residual_RD.dtype != x_RD.dtype
    ):
        raise ValueError(
            f"residual must match x ({tuple(x_RD.shape)}, {x_RD.dtype}); got "
            f"{tuple(residual_RD.shape)}, {residual_RD.dtype}"
        )


def rms_norm_fwd(
    x: torch.Tensor, weight_D: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """Raw forward (no autograd) on x [..., D]: (y, s, rstd). s is x + residual (x itself
    without a residual); rstd [...] is fp32."""
    D = x.shape[-1]
    lead = x.shape[:-1]
    x_RD = x.reshape(-1, D)
    residual_RD = None if residual is None else residual.reshape(-1, D)
    y_RD, s_RD, rstd_R = _fwd(x_RD, weight_D, eps, residual_RD)
    return y_RD.view(x.shape), s_RD.view(x.shape), rstd_R.view(lead)


def _fwd(x_RD, weight_D, eps, residual_RD):
    _check(x_RD, weight_D, residual_RD)
    x_RD = x_RD.contiguous()
    R, D = x_RD.shape
    y_RD = torch.empty_like(x_RD)
    s_RD = torch.empty_like(x_RD) if residual_RD is not None else x_RD
    rstd_R = torch.empty(R, dtype=torch.float32, device=x_RD.device)
    block_r, block_d, warps = row_blocks(x_RD, D)
    if R:
        rmsnorm_fwd_kernel[(triton.cdiv(R, block_r),)](
            x_RD, residual_RD.contiguous() if residual_RD is not None else x_RD,
            weight_D.contiguous(), y_RD, s_RD, rstd_R, R, D, float(eps),
            HAS_RES=residual_RD is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
        )  # fmt: skip
    return y_RD, s_RD, rstd_R


def rms_norm_bwd(
    gy: torch.Tensor,
    s: torch.Tensor,
    weight_D: torch.Tensor,
    rstd: torch.Tensor,
    gs: torch.Tensor | None = None,
):
    """Raw backward (no autograd) on [..., D]: (ds, gw_D). ds is the gradient of x (and of
    the residual); gs, the gradient reaching the residual-sum output, is added to it."""
    D = s.shape[-1]
    flat = [None if t is None else t.reshape(-1, D) for t in (gy, s, gs)]
    ds_RD, gw_D = _bwd(flat[0], flat[1], weight_D, rstd.reshape(-1), flat[2])
    return ds_RD.view(s.shape), gw_D


def _bwd(gy_RD, s_RD, weight_D, rstd_R, gs_RD):
    R, D = s_RD.shape
    gy_RD = gy_RD.contiguous()
    ds_RD = torch.empty_like(s_RD)
    block_r, block_d, warps = row_blocks(s_RD, D)
    programs = triton.cdiv(R, block_r)
    gw_PD = torch.zeros(max(programs, 1), D, dtype=torch.float32, device=s_RD.device)
    if R:
        rmsnorm_bwd_kernel[(programs,)](
            gy_RD, gs_RD.contiguous() if gs_RD is not None else gy_RD, s_RD,
            weight_D.contiguous(), rstd_R, ds_RD, gw_PD, R, D,
            HAS_GS=gs_RD is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
        )  # fmt: skip
    return ds_RD, gw_PD.sum(0).to(weight_D.dtype)
