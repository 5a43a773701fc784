"""SwiGLU (or another gated activation) times the routing weight, forward and backward,
one pass over memory each.

Algorithm. Row s of h_S2F holds gate = columns [0, F) and up = columns [F, 2F)
(interleaved: gate = even columns, up = odd). With act(gate, up) and its two partial
derivatives from `activation_kernels.glu` (for swiglu, sig = sigmoid(gate)):

    a[s, f]       = act * p[s]                      (swiglu: gate * sig * up * p[s])
    grad_gate     = g * p[s] * d act/d gate         (swiglu: up * sig * (1 + gate * (1 - sig)))
    grad_up       = g * p[s] * d act/d up           (swiglu: gate * sig)
    grad_p[s]     = sum_f g * act

Forward: one program per tile of rows x columns. Backward: one program per tile of
rows walks the F columns in tiles, so the grad_p row sum is a fixed-order register
reduction (deterministic, no atomics); it can also write the recomputed activation `a`
(the down projection's weight grad needs it), so nothing but h and p is saved.
`activation` is any kind of `specs.KERNEL_KINDS` (a constexpr: one compiled kernel per
kind; formulas in `specs.ACTIVATION_KINDS`). Math is in fp32; outputs are in h's dtype.
Semantics equal `dropless.ops.swiglu`.
"""

# S rows (sorted pairs), F expert hidden dim

# `# fmt: skip` below: a kernel's signature and its launches keep their arguments as a few
# lines of names (the formatter puts one per line, which makes each kernel a page of names)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import check_2d, row_blocks
from ..permute.row_ops import registered_row_ops
from ..specs import ActivationConfig
from .activation_kernels import KINDS, glu, glu_fwd
from .swiglu import activation as ops_activation

_GPT_OSS = ActivationConfig("gpt_oss")  # the alpha/limit defaults


@triton.jit
def gate_up_cols(offs_f, F, INTERLEAVED: tl.constexpr):
    if INTERLEAVED:
        col_g = offs_f * 2
        col_u = col_g + 1
    else:
        col_g = offs_f
        col_u = offs_f + F
    return col_g, col_u


@triton.jit
def swiglu_fwd_kernel(
    h_ptr, p_ptr, a_ptr, S, F, stride_h, stride_a, alpha, limit,
    HAS_P: tl.constexpr, INTERLEAVED: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_r = offs_r < S
    mask = mask_r[:, None] & (offs_f < F)[None, :]
    rows = offs_r.to(tl.int64)[:, None]
    col_g, col_u = gate_up_cols(offs_f, F, INTERLEAVED)
    gate = tl.load(h_ptr + rows * stride_h + col_g[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + rows * stride_h + col_u[None, :], mask=mask, other=0.0).to(tl.float32)
    a = glu_fwd(gate, up, alpha, limit, ACTIVATION)
    if HAS_P:
        a = a * tl.load(p_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)[:, None]
    tl.store(a_ptr + rows * stride_a + offs_f[None, :], a.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    g_ptr, h_ptr, p_ptr, gh_ptr, gp_ptr, a_ptr, S, F, stride_g, stride_h, stride_gh, stride_a,
    alpha, limit, HAS_P: tl.constexpr, NEED_GP: tl.constexpr, RECOMPUTE: tl.constexpr,
    INTERLEAVED: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < S
    rows = offs_r.to(tl.int64)[:, None]
    p = tl.full((BLOCK_R,), 1.0, tl.float32)
    if HAS_P:
        p = tl.load(p_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    acc_p = tl.zeros((BLOCK_R, BLOCK_F), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        offs_f = f0 + tl.arange(0, BLOCK_F)
        mask = mask_r[:, None] & (offs_f < F)[None, :]
        col_g, col_u = gate_up_cols(offs_f, F, INTERLEAVED)
        gate = tl.load(h_ptr + rows * stride_h + col_g[None, :], mask=mask, other=0.0)
        up = tl.load(h_ptr + rows * stride_h + col_u[None, :], mask=mask, other=0.0)
        g = tl.load(g_ptr + rows * stride_g + offs_f[None, :], mask=mask, other=0.0)
        gate, up, g = gate.to(tl.float32), up.to(tl.float32), g.to(tl.float32)
        act, d_gate, d_up = glu(gate, up, alpha, limit, ACTIVATION)
        if NEED_GP:
            acc_p += g * act
        gp = g * p[:, None]
        ty = gh_ptr.dtype.element_ty
        tl.store(gh_ptr + rows * stride_gh + col_g[None, :], (gp * d_gate).to(ty), mask=mask)
        tl.store(gh_ptr + rows * stride_gh + col_u[None, :], (gp * d_up).to(ty), mask=mask)
        if RECOMPUTE:
            a = (act * p[:, None]).to(a_ptr.dtype.element_ty)
            tl.store(a_ptr + rows * stride_a + offs_f[None, :], a, mask=mask)
    if NEED_GP:
        tl.store(gp_ptr + offs_r, tl.sum(acc_p, axis=1).to(gp_ptr.dtype.element_ty), mask=mask_r)


def _check(h_S2F: torch.Tensor, prob_S: torch.Tensor | None, activation: str) -> torch.Tensor:
    check_2d("h_S2F", h_S2F)
    if h_S2F.shape[1] % 2:
        raise ValueError(f"h must be [S, 2F] with an even column count, got {tuple(h_S2F.shape)}")
    if prob_S is not None and prob_S.shape != (h_S2F.shape[0],):
        raise ValueError(f"prob_S must be [S]={h_S2F.shape[0]}, got {tuple(prob_S.shape)}")
    if activation not in KINDS:
        raise ValueError(f"activation={activation!r}; allowed: {KINDS}")
    return h_S2F if h_S2F.stride(-1) == 1 else h_S2F.contiguous()


def swiglu_fwd(
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None = None,
    interleaved: bool = False,
    activation: str = "swiglu",
    alpha: float = _GPT_OSS.alpha,
    limit: float = _GPT_OSS.limit,
) -> torch.Tensor:
    """a[s] = act(gate[s], up[s]) * prob[s] (prob = 1 when None); raw, no autograd. act is
    the gated kind `activation` of `specs.KERNEL_KINDS` (`activation_kernels.glu`)."""
    h_S2F = _check(h_S2F, prob_S, activation)
    S, F = h_S2F.shape[0], h_S2F.shape[1] // 2
    a_SF = h_S2F.new_empty(S, F)
    if S == 0 or F == 0:
        return a_SF
    br, bf, warps = row_blocks(h_S2F, F)
    p = prob_S.contiguous() if prob_S is not None else h_S2F
    grid = (triton.cdiv(S, br), triton.cdiv(F, bf))
    swiglu_fwd_kernel[grid](
        h_S2F, p, a_SF, S, F, h_S2F.stride(0), a_SF.stride(0), float(alpha), float(limit),
        HAS_P=prob_S is not None, INTERLEAVED=interleaved, ACTIVATION=activation,
        BLOCK_R=br, BLOCK_F=bf, num_warps=warps,
    )  # fmt: skip
    return a_SF


def swiglu_bwd(
    grad_SF: torch.Tensor,
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None = None,
    interleaved: bool = False,
    need_prob_grad: bool = True,
    recompute: bool = False,
    activation: str = "swiglu",
    alpha: float = _GPT_OSS.alpha,
    limit: float = _GPT_OSS.limit,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw backward of `swiglu_fwd`: returns (grad_h_S2F, grad_prob_S or None, a_SF or None).

    grad_prob is computed when prob_S is given and need_prob_grad; with recompute=True
    the forward activation a_SF is written in the same pass (for the down-projection
    weight grad), so a memory-lean caller saves only h and prob.
    """
    h_S2F = _check(h_S2F, prob_S, activation)
    S, F = h_S2F.shape[0], h_S2F.shape[1] // 2
    if grad_SF.shape != (S, F):
        raise ValueError(f"grad must be [S, F]={(S, F)}, got {tuple(grad_SF.shape)}")
    grad_SF = grad_SF if grad_SF.stride(-1) == 1 else grad_SF.contiguous()
    need_gp = prob_S is not None and need_prob_grad
    grad_h = h_S2F.new_empty(S, 2 * F)
    grad_p = torch.empty(S, dtype=prob_S.dtype, device=h_S2F.device) if need_gp else None
    a_SF = h_S2F.new_empty(S, F) if recompute else None
    if S == 0 or F == 0:
        return grad_h, (grad_p.zero_() if need_gp else None), a_SF
    br, bf, warps = row_blocks(h_S2F, F)
    if h_S2F.is_cuda:  # several rows per program, the F loop walks the columns
        br, bf = 4, min(bf, 512)
    swiglu_bwd_kernel[(triton.cdiv(S, br),)](
        grad_SF, h_S2F,
        prob_S.contiguous() if prob_S is not None else h_S2F,
        grad_h, grad_p if need_gp else h_S2F, a_SF if recompute else h_S2F,
        S, F, grad_SF.stride(0), h_S2F.stride(0), grad_h.stride(0),
        a_SF.stride(0) if recompute else 0, float(alpha), float(limit),
        HAS_P=prob_S is not None, NEED_GP=need_gp, RECOMPUTE=recompute,
        INTERLEAVED=interleaved, ACTIVATION=activation,
        BLOCK_R=br, BLOCK_F=bf, num_warps=warps,
    )  # fmt: skip
    return grad_h, grad_p, a_SF


def swiglu(
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None = None,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = _GPT_OSS.alpha,
    limit: float = _GPT_OSS.limit,
) -> torch.Tensor:
    """act(gate, up) * prob with autograd (saves h and prob only); see `swiglu_fwd`.

    Same signature and semantics as `dropless.ops.swiglu` (its autograd Function, with
    these kernels).
    """
    _check(h_S2F, prob_S, activation)
    return ops_activation(
        h_S2F,
        prob_S,
        registered_row_ops("triton"),
        activation=activation,
        interleaved=interleaved,
        alpha=alpha,
        limit=limit,
    )
