"""Triton kernel: the SwiGLU x prob backward of the FP8 MLP, writing the recomputed
activation directly in FP8 for the down projection's weight gradient.

Per-tensor scaling (current per tensor, delayed) reuses the forward's scale for the
activation the down weight gradient reads, so its scale is known before the backward
pass: one program per BLOCK_R rows walks F in tiles and, from h = [gate | up], the
routing prob p and the gradient g of the activation, writes

    grad_gate = g * p * d act/d gate,   grad_up = g * p * d act/d up   (h's dtype)
    grad_p[s] = sum_f g * act                                          (fixed-order sum)
    q[s, f]   = sat_e4m3(act * p * scale)                              (one byte)

so the activation is never written in 16 bits and read again to be quantized. The
derivative math is `activation_kernels.glu`'s and the E4M3 encoding
`triton_fp8.e4m3_code`'s (torch's bytes). Row-wise and MX recipes quantize that
activation column-wise over all rows (a column amax first): they take the row op's
backward (`ops.permute.row_ops`) and quantize after.
"""

# S rows (sorted pairs), F expert hidden dim

# `# fmt: skip` below: a kernel's signature and its launches keep their arguments as a few
# lines of names (the formatter puts one per line, which makes each kernel a page of names)

from __future__ import annotations

import torch

from ..quantize.triton_fp8 import e4m3_code, tl, triton
from .activation_kernels import glu


@triton.jit
def bwd_quant_kernel(
    g_ptr, h_ptr, p_ptr, scale_ptr, gh_ptr, gp_ptr, q_ptr, S, F,
    stride_g, stride_h, stride_gh, stride_q,
    HAS_P: tl.constexpr, NEED_GP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < S
    rows = offs_r.to(tl.int64)[:, None]
    p = tl.full((BLOCK_R,), 1.0, tl.float32)
    if HAS_P:
        p = tl.load(p_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    acc_p = tl.zeros((BLOCK_R, BLOCK_F), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = (f0 + tl.arange(0, BLOCK_F))[None, :]
        mask = mask_r[:, None] & (cols < F)
        gate = tl.load(h_ptr + rows * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + rows * stride_h + cols + F, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        act, d_gate, d_up = glu(gate, up, 0.0, 0.0, "swiglu")
        if NEED_GP:
            acc_p += g * act
        gp = g * p[:, None]
        ty = gh_ptr.dtype.element_ty
        tl.store(gh_ptr + rows * stride_gh + cols, (gp * d_gate).to(ty), mask=mask)
        tl.store(gh_ptr + rows * stride_gh + cols + F, (gp * d_up).to(ty), mask=mask)
        code = e4m3_code(act * p[:, None] * scale)
        tl.store(q_ptr + rows * stride_q + cols, code.to(tl.uint8), mask=mask)
    if NEED_GP:
        tl.store(gp_ptr + offs_r, tl.sum(acc_p, axis=1).to(gp_ptr.dtype.element_ty), mask=mask_r)


def bwd_quant(
    grad_SF: torch.Tensor,
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None,
    scale: torch.Tensor,
    *,
    need_prob_grad: bool = True,
    grad_dtype: torch.dtype | None = None,
    block_r: int = 4,
):
    """(grad_h [S, 2F] in `grad_dtype` (default h's), grad_prob [S] or None, the
    activation silu(gate) * up * prob in E4M3 bytes [S, F] with the per-tensor `scale`)."""
    if h_S2F.dim() != 2 or h_S2F.shape[1] % 2:
        raise ValueError(f"h must be [S, 2F], got {tuple(h_S2F.shape)}")
    h = h_S2F.contiguous()
    S, F = h.shape[0], h.shape[1] // 2
    if tuple(grad_SF.shape) != (S, F):
        raise ValueError(f"grad must be [S, F]={(S, F)}, got {tuple(grad_SF.shape)}")
    g = grad_SF.contiguous()
    need_gp = prob_S is not None and need_prob_grad
    grad_h = torch.empty(S, 2 * F, dtype=grad_dtype or h.dtype, device=h.device)
    grad_p = torch.zeros(S, dtype=prob_S.dtype, device=h.device) if need_gp else None
    q = torch.empty(S, F, dtype=torch.uint8, device=h.device)
    scale = scale.float().reshape(()).to(h.device)
    if S and F:
        block_f = min(triton.next_power_of_2(F), 512 if h.is_cuda else 32)
        bwd_quant_kernel[(triton.cdiv(S, block_r),)](
            g, h, prob_S.contiguous() if prob_S is not None else h, scale, grad_h,
            grad_p if need_gp else h, q, S, F, g.stride(0), h.stride(0), grad_h.stride(0),
            q.stride(0), HAS_P=prob_S is not None, NEED_GP=need_gp, BLOCK_R=block_r,
            BLOCK_F=block_f,
        )  # fmt: skip
    return grad_h, grad_p, q.view(torch.float8_e4m3fn)
