"""Triton kernel: SwiGLU x routing prob, quantized to E4M3 for the down GEMM, in one pass.

Each program reads a [BLOCK_S, 32] tile of gate and the matching tile of up
(h = [gate | up], [S, 2F]), computes a = silu(gate) * up * prob in fp32, and writes
only the quantized a:

- MXFP8 mode: the tile is BLOCK_S rows of one 32-column MX block, so the block amax is
  a row max of the tile (`triton_fp8.mx_encode`); columns past F (the last partial
  block) are zeros.
- scaled mode (delayed scaling: the scale is known before the pass): q = a * scale
  (saturating; a NaN keeps its sign bit, as torch's cast), and each program writes its
  tile's amax for the history.

The E4M3 and E8M0 encodings are those of `triton_fp8.py` (integer ops on the fp32
bits), so the interpreter and the GPU give the same bytes as torch's cast. ACT=False
skips the silu (gate * up * prob): that mode is what the bit-exact tests use, since exp
may differ by an ulp between libraries.
"""

# S rows (sorted pairs), F expert hidden dim, B MX blocks per row

from __future__ import annotations

import torch

from ..kernels.activations import glu_fwd
from .formats import BLOCK, QTensor
from .triton_fp8 import e4m3_code, mx_encode, tl, triton


@triton.jit
def _offsets(rows, cols, stride):
    """rows x stride + cols in int64: at real sizes an [S, 2F] tensor passes 2**31
    elements (S = 131072, F = 8192), where int32 products wrap around."""
    return rows.to(tl.int64)[:, None] * stride + cols[None, :]


@triton.jit
def _swiglu_tile(
    h_ptr, prob_ptr, rows, cols, S, F, stride_h, HAS_PROB: tl.constexpr, ACT: tl.constexpr
):
    mask = (rows < S)[:, None] & (cols < F)[None, :]
    offs = _offsets(rows, cols, stride_h)
    gate = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
    if ACT:
        a = glu_fwd(gate, up, 0.0, 0.0, "swiglu")
    else:
        a = gate * up
    if HAS_PROB:
        p = tl.load(prob_ptr + rows, mask=rows < S, other=0.0).to(tl.float32)
        a = a * p[:, None]
    return a


@triton.jit
def _mx_kernel(
    h_ptr,
    prob_ptr,
    q_ptr,
    s_ptr,
    S,
    F,
    stride_h,
    stride_q,
    stride_s,
    HAS_PROB: tl.constexpr,
    ACT: tl.constexpr,
    RCEIL: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    blk = tl.program_id(1)
    cols = blk * 32 + tl.arange(0, 32)
    a = _swiglu_tile(h_ptr, prob_ptr, rows, cols, S, F, stride_h, HAS_PROB, ACT)
    code, sbits = mx_encode(a, RCEIL)
    row_ok = rows < S
    tl.store(q_ptr + _offsets(rows, cols, stride_q), code.to(tl.uint8), mask=row_ok[:, None])
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + blk, sbits.to(tl.uint8), mask=row_ok)


@triton.jit
def _scaled_kernel(
    h_ptr,
    prob_ptr,
    scale_ptr,
    q_ptr,
    amax_ptr,
    S,
    F,
    stride_h,
    stride_q,
    HAS_PROB: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    a = _swiglu_tile(h_ptr, prob_ptr, rows, cols, S, F, stride_h, HAS_PROB, ACT)
    scale = tl.load(scale_ptr)
    code = e4m3_code(a * scale)
    mask = (rows < S)[:, None] & (cols < F)[None, :]
    tl.store(q_ptr + _offsets(rows, cols, stride_q), code.to(tl.uint8), mask=mask)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(amax_ptr + pid, tl.max(tl.max(tl.abs(a), axis=1), axis=0))


def _check(h_S2F: torch.Tensor, prob_S):
    if h_S2F.dim() != 2 or h_S2F.shape[1] % 2:
        raise ValueError(f"h must be [S, 2F], got {tuple(h_S2F.shape)}")
    h = h_S2F.contiguous()
    prob = prob_S.contiguous() if prob_S is not None else h.new_zeros(1)
    return h, prob, h.shape[0], h.shape[1] // 2


def swiglu_quant_mx(
    h_S2F, prob_S=None, *, fmt="e4m3", scale_rule="floor", act=True, block_s=32
) -> QTensor:
    """silu(gate) * up * prob as MXFP8 (E4M3, blocks of 32 along F): QTensor like
    `formats.quantize_mx(a, 1)` (data [S, B*32], E8M0 scale_inv [S, B])."""
    if fmt != "e4m3":
        raise ValueError(f"the fused kernel writes E4M3 only, got fmt={fmt!r}")
    h, prob, S, F = _check(h_S2F, prob_S)
    B = -(-F // BLOCK)
    q = torch.empty(S, B * BLOCK, dtype=torch.uint8, device=h.device)
    s = torch.empty(S, B, dtype=torch.uint8, device=h.device)
    if S:
        grid = (triton.cdiv(S, block_s), B)
        _mx_kernel[grid](
            h,
            prob,
            q,
            s,
            S,
            F,
            h.stride(0),
            q.stride(0),
            s.stride(0),
            HAS_PROB=prob_S is not None,
            ACT=act,
            RCEIL=scale_rule == "rceil",
            BLOCK_S=block_s,
        )
    return QTensor(
        q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), "e4m3", kind="mx", dim=1, size=F
    )


def swiglu_quant_scaled(
    h_S2F, prob_S, fmt: str, scale: torch.Tensor, *, act=True, block_s=32, block_f=64
):
    """silu(gate) * up * prob quantized with a known per-tensor scale (delayed scaling).
    Returns (QTensor, amax of the unquantized result)."""
    if fmt != "e4m3":
        raise ValueError(f"the fused kernel writes E4M3 only, got fmt={fmt!r}")
    h, prob, S, F = _check(h_S2F, prob_S)
    scale = scale.float().reshape(1).to(h.device)
    q = torch.empty(S, F, dtype=torch.uint8, device=h.device)
    grid = (triton.cdiv(S, block_s), triton.cdiv(F, block_f))
    partial = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device=h.device)
    if S and F:
        _scaled_kernel[grid](
            h,
            prob,
            scale,
            q,
            partial,
            S,
            F,
            h.stride(0),
            q.stride(0),
            HAS_PROB=prob_S is not None,
            ACT=act,
            BLOCK_S=block_s,
            BLOCK_F=block_f,
        )
    qt = QTensor(
        q.view(torch.float8_e4m3fn),
        torch.reciprocal(scale.reshape(())),
        "e4m3",
        scale=scale.reshape(()),
    )
    return qt, partial.amax() if partial.numel() else partial.new_zeros(())
