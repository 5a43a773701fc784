"""Permute / unpermute (combine) kernels: every direction is a deterministic gather.

Algorithm. Pairs (t, k) sorted by expert sit in slots s; token_S maps a slot to its
token, pair_S to its flat pair t*K+k, slot_TK a pair to its slot (>= S: dropped).

- gather_rows: out[s] = x[index[s]] (* scale[scale_index[s]]); one program copies a
  tile of rows x columns. Permute forward, and the grad of the combine's rows.
- gather_sum: out[t] = sum_k w[t,k] * rows[slot[t,k]], k in order 0..K-1, accumulated
  in fp32 in registers; slots >= S read as zero. Combine forward, and permute's
  backward (grad of x). No scatter, no atomics: the same bits on every run.
- pair_dot: dots[t,k] = <g[t], y[slot[t,k]]> (0 for a dropped pair); one program
  handles a tile of pairs and walks the feature dim in tiles: the routing-weight grad.

Semantics equal `dropless.ops.permute` / `unpermute` and the references in
`reference.py`.
"""

# T tokens, D model dim, N features, K top-k, S sorted (kept) pairs

# `# fmt: skip` below: a kernel's signature and its launches keep their arguments as a few
# lines of names (the formatter puts one per line, which makes each kernel a page of names)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import check_2d, check_index, row_blocks
from .eager import Permute, Unpermute, UnpermuteUnweighted
from .row_ops import registered_row_ops


@triton.jit
def gather_rows_kernel(
    x_ptr, idx_ptr, scale_ptr, sidx_ptr, out_ptr, S, N, stride_x, stride_o,
    HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_r = offs_r < S
    mask = mask_r[:, None] & (offs_n < N)[None, :]
    src = tl.load(idx_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
    row = tl.load(x_ptr + src[:, None] * stride_x + offs_n[None, :], mask=mask, other=0.0)
    if HAS_SCALE:
        sidx = tl.load(sidx_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
        scale = tl.load(scale_ptr + sidx, mask=mask_r, other=0.0).to(tl.float32)
        row = row.to(tl.float32) * scale[:, None]
    dst = out_ptr + offs_r.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(dst, row.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gather_sum_kernel(
    rows_ptr, slot_ptr, w_ptr, out_ptr, T, N, S, stride_r, stride_o,
    K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_t = offs_t < T
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for k in tl.static_range(K):
        slot = tl.load(slot_ptr + offs_t * K + k, mask=mask_t, other=S).to(tl.int64)
        valid = mask_t & (slot < S)
        src = rows_ptr + slot[:, None] * stride_r + offs_n[None, :]
        row = tl.load(src, mask=valid[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + offs_t * K + k, mask=mask_t, other=0.0).to(tl.float32)
            row = row * w[:, None]
        acc += row
    dst = out_ptr + offs_t.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_n[None, :])


@triton.jit
def pair_dot_kernel(
    g_ptr, y_ptr, slot_ptr, out_ptr, P, N, S, stride_g, stride_y,
    K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    tok = (offs_p // K).to(tl.int64)
    slot = tl.load(slot_ptr + offs_p, mask=mask_p, other=S).to(tl.int64)
    valid = mask_p & (slot < S)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = (offs_n < N)[None, :]
        g = tl.load(
            g_ptr + tok[:, None] * stride_g + offs_n[None, :],
            mask=valid[:, None] & mask_n,
            other=0.0,
        )
        y = tl.load(
            y_ptr + slot[:, None] * stride_y + offs_n[None, :],
            mask=valid[:, None] & mask_n,
            other=0.0,
        )
        acc += g.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + offs_p, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=mask_p)


# --- raw wrappers (no autograd) -----------------------------------------------------


def gather_rows(
    x_TD: torch.Tensor,
    index_S: torch.Tensor,
    scale: torch.Tensor | None = None,
    scale_index_S: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[s] = x[index[s]] (* scale[scale_index[s]]), in x's dtype. scale is read flat."""
    check_2d("x", x_TD)
    check_index("index_S", index_S, 1)
    x_TD = x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()
    S, N = index_S.shape[0], x_TD.shape[1]
    out = x_TD.new_empty(S, N)
    if S == 0 or N == 0:
        return out
    has_scale = scale is not None
    if has_scale:
        scale = scale.reshape(-1).contiguous()
        sidx = index_S if scale_index_S is None else scale_index_S
        check_index("scale_index_S", sidx, 1)
        sidx = sidx.contiguous()
    else:
        scale = sidx = index_S  # unused placeholders
    br, bn, warps = row_blocks(x_TD, N)
    grid = (triton.cdiv(S, br), triton.cdiv(N, bn))
    gather_rows_kernel[grid](
        x_TD, index_S.contiguous(), scale, sidx, out, S, N, x_TD.stride(0), out.stride(0),
        HAS_SCALE=has_scale, BLOCK_R=br, BLOCK_N=bn, num_warps=warps,
    )  # fmt: skip
    return out


def gather_sum(
    rows_SN: torch.Tensor, slot_TK: torch.Tensor, weights_TK: torch.Tensor | None = None
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * rows[slot[t,k]] (w = 1 when None); slots >= S read as zero.

    Accumulates in fp32, in k order; output in rows' dtype.
    """
    check_2d("rows_SN", rows_SN)
    check_index("slot_TK", slot_TK, 2)
    rows_SN = rows_SN if rows_SN.stride(-1) == 1 else rows_SN.contiguous()
    (T, K), (S, N) = slot_TK.shape, rows_SN.shape
    out = rows_SN.new_empty(T, N)
    if T == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if weights_TK is not None and weights_TK.shape != slot_TK.shape:
        raise ValueError(f"weights_TK {tuple(weights_TK.shape)} must match slot_TK {(T, K)}")
    w = weights_TK.contiguous() if weights_TK is not None else slot_TK
    br, bn, warps = row_blocks(rows_SN, N)
    grid = (triton.cdiv(T, br), triton.cdiv(N, bn))
    gather_sum_kernel[grid](
        rows_SN, slot_TK.contiguous(), w, out, T, N, S, rows_SN.stride(0), out.stride(0),
        K=K, HAS_W=weights_TK is not None, BLOCK_R=br, BLOCK_N=bn, num_warps=warps,
    )  # fmt: skip
    return out


def pair_dot(g_TN: torch.Tensor, y_SN: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """dots[t,k] = <g[t], y[slot[t,k]]> in fp32 (0 where slot >= S): the grad of w[t,k]."""
    check_2d("g_TN", g_TN)
    check_2d("y_SN", y_SN)
    check_index("slot_TK", slot_TK, 2)
    g_TN = g_TN if g_TN.stride(-1) == 1 else g_TN.contiguous()
    y_SN = y_SN if y_SN.stride(-1) == 1 else y_SN.contiguous()
    (T, K), (S, N) = slot_TK.shape, y_SN.shape
    out = torch.zeros(T, K, dtype=torch.float32, device=y_SN.device)
    if T * K == 0 or N == 0:
        return out
    br, bn, warps = row_blocks(y_SN, N)
    bp = br if not y_SN.is_cuda else 16
    bn = bn if not y_SN.is_cuda else min(bn, 256)
    grid = (triton.cdiv(T * K, bp),)
    pair_dot_kernel[grid](
        g_TN, y_SN, slot_TK.contiguous(), out, T * K, N, S, g_TN.stride(0), y_SN.stride(0),
        K=K, BLOCK_P=bp, BLOCK_N=bn, num_warps=warps,
    )  # fmt: skip
    return out


# --- autograd: the Functions of dropless.ops.permute with these kernels --------------


def permute(x_TD: torch.Tensor, token_S: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """x_SD[s] = x_TD[token_S[s]], with autograd (backward: gather-sum over slot_TK).

    token_S / slot_TK come from `dropless.ops.sort_by_expert` (`sp.token_S`, `sp.slot_TK`).
    """
    return Permute.apply(x_TD, token_S, slot_TK, registered_row_ops("triton"))


def unpermute(
    y_SN: torch.Tensor,
    token_S: torch.Tensor,
    pair_S: torch.Tensor,
    slot_TK: torch.Tensor,
    weights_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * y[slot[t,k]] (w = 1 when None), with autograd.

    Backward: grad_y[s] = w[pair_S[s]] * g[token_S[s]], grad_w[t,k] = <g[t], y[slot[t,k]]>.
    Index tensors come from `dropless.ops.sort_by_expert`.
    """
    if weights_TK is None:
        return UnpermuteUnweighted.apply(y_SN, token_S, slot_TK, registered_row_ops("triton"))
    return Unpermute.apply(y_SN, weights_TK, token_S, pair_S, slot_TK, registered_row_ops("triton"))
