"""Triton kernels for the FP8 casts of 2-D tensors on CUDA: one pass each, no fp32 copy.

The torch forms in `formats.py` (the specification, and what CPU runs) read and write
~25 bytes per element in fp32 temporaries where the cast needs 3; these kernels do the
same arithmetic in registers and give the same bytes: `scale_cast` (also 3-D grouped
weights, one scale per expert), `dequant_scaled`, `mx_quantize` (MXFP8 blocks of 32 along
the last dim, "floor" or "rceil") and `mx_dequant`. Every kernel takes arbitrary 2-D
strides, so a transposed view needs no copy; offsets are int64. E4M3 only: the E5M2
gradients of HYBRID recipes take the torch path. Tested bit for bit against the torch
path under TRITON_INTERPRET=1.
"""

# M rows, N columns, B MX blocks per row

from __future__ import annotations

import torch

from .triton_fp8 import MX_BLOCK, e4m3_code, e4m3_value, mx_encode, tl, triton

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu


@triton.jit
def _offs(rows, cols, s0, s1):
    return rows.to(tl.int64)[:, None] * s0 + cols.to(tl.int64)[None, :] * s1


@triton.jit
def scale_cast_kernel(
    x_ptr, s_ptr, q_ptr, M, N, sxe, sx0, sx1, sse, ss0, ss1, sqe, sq0, sq1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # axis 2: the leading (expert) dim of a 3-D tensor; one program column for 2-D
    e = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    xo = e * sxe + _offs(rows, cols, sx0, sx1)
    x = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + e * sse + _offs(rows, cols, ss0, ss1), mask=mask, other=1.0)
    code = e4m3_code(x * s)
    tl.store(q_ptr + e * sqe + _offs(rows, cols, sq0, sq1), code.to(tl.uint8), mask=mask)


@triton.jit
def mx_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, N, sx0, sx1, sq0, ss0,
    RCEIL: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blk = tl.program_id(1)
    cols = blk * 32 + tl.arange(0, 32)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    a = tl.load(x_ptr + _offs(rows, cols, sx0, sx1), mask=mask, other=0.0).to(tl.float32)
    code, sbits = mx_encode(a, RCEIL)
    q_offs = rows.to(tl.int64)[:, None] * sq0 + cols.to(tl.int64)[None, :]
    tl.store(q_ptr + q_offs, code.to(tl.uint8), mask=row_ok[:, None])
    tl.store(s_ptr + rows.to(tl.int64) * ss0 + blk, sbits.to(tl.uint8), mask=row_ok)


@triton.jit
def dequant_kernel(
    q_ptr, s_ptr, o_ptr, M, N, sq0, sq1, ss0, ss1, so0, so1,
    MX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # MX: s holds E8M0 bytes, one per block of 32 along a row; else fp32 scales per element
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    code = tl.load(q_ptr + _offs(rows, cols, sq0, sq1), mask=mask, other=0).to(tl.int32)
    if MX:
        sb = tl.load(s_ptr + _offs(rows, cols // 32, ss0, ss1), mask=mask, other=127)
        sb = sb.to(tl.int32)
        # 2**(sb - 127): a normal float for sb >= 1, the subnormal 2**-127 for sb == 0
        x = tl.where(sb > 0, sb << 23, 0x400000).to(tl.float32, bitcast=True)
        x = tl.where(sb == 255, float("nan"), x)
    else:
        x = tl.load(s_ptr + _offs(rows, cols, ss0, ss1), mask=mask, other=1.0)
    y = e4m3_value(code) * x
    tl.store(o_ptr + _offs(rows, cols, so0, so1), y.to(o_ptr.dtype.element_ty), mask=mask)


def _grid(M: int, N: int, bm: int, bn: int) -> tuple[int, int]:
    return (triton.cdiv(M, bm), triton.cdiv(N, bn))


def scale_cast(x: torch.Tensor, scale: torch.Tensor, block=(32, 128)) -> torch.Tensor:
    """sat_cast_e4m3(x * scale) for 2-D x [M, N] or 3-D x [E, M, N] (a grouped weight, its
    experts along the grid's third axis); scale fp32 broadcastable to x (scalar, a row, a
    column, one per expert). Returns a contiguous E4M3 tensor of x's shape."""
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    E, M, N = x3.shape
    s = scale.to(x.device, torch.float32)
    s = s.reshape([1] * (x.dim() - s.dim()) + list(s.shape)).expand(x.shape)
    s3 = s if s.dim() == 3 else s.unsqueeze(0)
    q = torch.empty(E, M, N, dtype=torch.uint8, device=x.device)
    if E and M and N:
        grid = (*_grid(M, N, *block), E)
        scale_cast_kernel[grid](
            x3, s3, q, M, N, *x3.stride(), *s3.stride(), *q.stride(),
            BLOCK_M=block[0], BLOCK_N=block[1],
        )  # fmt: skip
    return q.view(E4M3).view(x.shape)


def dequant_scaled(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block=(32, 128)
) -> torch.Tensor:
    """(q * scale_inv) in fp32, as `dtype`, for 2-D E4M3 q; scale_inv broadcastable."""
    M, N = q.shape
    s = scale_inv.to(q.device, torch.float32)
    s = s.reshape([1] * (2 - s.dim()) + list(s.shape)).expand(M, N)
    out = torch.empty(M, N, dtype=dtype, device=q.device)
    if M and N:
        dequant_kernel[_grid(M, N, *block)](
            q.view(torch.uint8), s, out, M, N, *q.stride(), *s.stride(), *out.stride(),
            MX=False, BLOCK_M=block[0], BLOCK_N=block[1],
        )  # fmt: skip
    return out


def mx_quantize(x: torch.Tensor, scale_rule: str = "floor", block_m: int = 32):
    """MXFP8 E4M3 of 2-D x (any strides) in blocks of 32 along the last dim: returns
    (data [M, B*32] E4M3, the partial last block zero padded; scales [M, B] E8M0)."""
    if scale_rule not in ("floor", "rceil"):
        raise ValueError(f"scale_rule={scale_rule!r}; allowed: ('floor', 'rceil')")
    M, N = x.shape
    B = -(-N // MX_BLOCK)
    q = torch.empty(M, B * MX_BLOCK, dtype=torch.uint8, device=x.device)
    s = torch.empty(M, B, dtype=torch.uint8, device=x.device)
    if M and B:
        mx_quant_kernel[(triton.cdiv(M, block_m), B)](
            x, q, s, M, N, *x.stride(), q.stride(0), s.stride(0),
            RCEIL=scale_rule == "rceil", BLOCK_M=block_m,
        )  # fmt: skip
    return q.view(E4M3), s.view(E8M0)


def mx_dequant(
    q: torch.Tensor, s: torch.Tensor, n: int, dtype: torch.dtype, block=(32, 128)
) -> torch.Tensor:
    """q [M, >= n] E4M3 (any strides) times its E8M0 block scales s [M, B] along the
    last dim: the first n columns, as a new [M, n] tensor of `dtype`."""
    M = q.shape[0]
    out = torch.empty(M, n, dtype=dtype, device=q.device)
    if M and n:
        dequant_kernel[_grid(M, n, *block)](
            q.view(torch.uint8), s.view(torch.uint8), out, M, n, *q.stride(), *s.stride(),
            *out.stride(), MX=True, BLOCK_M=block[0], BLOCK_N=block[1],
        )  # fmt: skip
    return out
