"""Cross-entropy of a chunk of logits and its gradient written over them, on CUDA.

Algorithm. One program per block of BLOCK_R rows of x_CV (a chunk of a language-model
head's logits, any float dtype, math in fp32) walks the V columns in tiles twice:

    pass 1 (online softmax): m = running max, z = sum_v exp(x - m), rescaled when m grows;
            the label's logit x_t, and sum_v x for label smoothing s
            lse = m + log z,   loss = (1 - s) * (lse - x_t) + s * (lse - sum_v x / V)
    pass 2 (with GRAD):  g = scale[r] * (exp(x - lse) - (1 - s) * [v == t] - s / V),
            stored over x in x's dtype

Rows whose label is `ignore_index` get loss 0 and gradient 0; scale_C is read from device
memory (the mean's 1 / count lives there), so nothing syncs with the host. The logits are
read twice and written once; the loss, lse and the gradient's row factor are per row.
Semantics: `dropless.ops.linear_cross_entropy.rows.ce_rows_eager` (the CPU path).
"""

# C rows (tokens of the chunk), V vocabulary

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import check_2d, on_gpu

# below any float32 logit, finite: the first tile's max replaces it without inf - inf
_NEG_BIG = tl.constexpr(-3.0e38)


@triton.jit
def ce_rows_kernel(
    x_ptr, labels_ptr, scale_ptr, loss_ptr, C, V, stride_x, ignore_index, smoothing,
    GRAD: tl.constexpr, SMOOTH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < C
    rows = offs_r.to(tl.int64)[:, None] * stride_x
    label = tl.load(labels_ptr + offs_r, mask=mask_r, other=ignore_index)
    valid = mask_r & (label != ignore_index)
    m = tl.full((BLOCK_R,), _NEG_BIG, tl.float32)
    z = tl.zeros((BLOCK_R,), tl.float32)
    x_t = tl.zeros((BLOCK_R,), tl.float32)
    x_sum = tl.zeros((BLOCK_R,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask = mask_r[:, None] & (offs_v < V)[None, :]
        x = tl.load(x_ptr + rows + offs_v[None, :], mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        z = z * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
        is_t = offs_v[None, :] == label[:, None]
        x_t += tl.sum(tl.where(is_t, x, 0.0), axis=1)
        if SMOOTH:
            x_sum += tl.sum(tl.where(mask, x, 0.0), axis=1)
    # rows past the chunk: a finite lse of 0, so their (unstored) lanes compute no inf
    lse = tl.where(mask_r, m, 0.0) + tl.log(tl.where(mask_r, z, 1.0))
    loss = lse - x_t
    if SMOOTH:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - x_sum / V)
    tl.store(loss_ptr + offs_r, tl.where(valid, loss, 0.0), mask=mask_r)
    if GRAD:
        scale = tl.load(scale_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        scale = tl.where(valid, scale, 0.0)
        for v0 in range(0, V, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask = mask_r[:, None] & (offs_v < V)[None, :]
            x = tl.load(x_ptr + rows + offs_v[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse[:, None])
            g -= tl.where(offs_v[None, :] == label[:, None], 1.0 - smoothing, 0.0)
            if SMOOTH:
                g -= smoothing / V
            g = g * scale[:, None]
            tl.store(x_ptr + rows + offs_v[None, :], g.to(x_ptr.dtype.element_ty), mask=mask)


def _blocks(x_CV: torch.Tensor, V: int) -> tuple[int, int, int]:
    """(rows per program, columns per tile, num_warps). On a GPU one row per program, a
    4,096-column tile (16 fp32 values per thread at 8 warps); under the interpreter tiny
    tiles, so test shapes span several programs and partial tiles."""
    if not on_gpu(x_CV):
        return 4, 16, 1
    block_v = min(triton.next_power_of_2(max(V, 1)), 4096)
    return 1, block_v, 8 if block_v >= 2048 else 4


def ce_rows(
    logits_CV: torch.Tensor,
    labels_C: torch.Tensor,
    scale_C: torch.Tensor,
    *,
    ignore_index: int,
    smoothing: float,
    grad: bool,
) -> torch.Tensor:
    """The cross-entropy row op (`dropless.ops.linear_cross_entropy.rows.CERows.run`): per-row
    loss (fp32), and with grad=True the gradient written over `logits_CV` in place."""
    check_2d("logits", logits_CV)
    if logits_CV.stride(1) != 1:
        raise ValueError("logits must have unit column stride (a row-major chunk)")
    C, V = logits_CV.shape
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C == 0:
        return loss_C
    block_r, block_v, warps = _blocks(logits_CV, V)
    ce_rows_kernel[(triton.cdiv(C, block_r),)](
        logits_CV, labels_C.contiguous(), scale_C.to(torch.float32).contiguous(), loss_C,
        C, V, logits_CV.stride(0), int(ignore_index), float(smoothing),
        GRAD=bool(grad), SMOOTH=bool(smoothing), BLOCK_R=block_r, BLOCK_V=block_v,
        num_warps=warps,
    )  # fmt: skip
    return loss_C
