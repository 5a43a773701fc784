"""Grouped GEMM over contiguous row groups (one group per expert), forward and wgrad.

Rows [off[e], off[e+1]) of `a` belong to group e, off the exclusive cumsum of counts, a
device tensor: a launch never reads it on the host.

- mm: y[rows of e] = a[rows of e] @ (b[e]^T if trans_b else b[e]). The M tiles of all
  groups are numbered group after group; each program finds its group from a cumsum of
  the tile counts. The grid takes the bound cdiv(S, BLOCK_M) + E on M tiles (programs past
  the last tile do nothing), and rows past a group's end are masked.
- wgrad: out[e] = a_e^T @ b_e; program (e, tile) walks group e's rows in BLOCK_K steps.

Accumulation is fp32; fp32 inputs use IEEE products unless torch's matmul precision
allows TF32, as torch.mm does. The "triton" grouped-GEMM backend (`gpu.register_gpu`).
"""

# S rows (sorted pairs), K reduction dim, N output features, M wgrad rows, E groups

# `# fmt: skip` below: a kernel's signature and its launches keep their arguments as a few
# lines of names (the formatter puts one per line, which makes each kernel a page of names)

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def group_of_tile(cnt_ptr, tile, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(group, first row of this tile, end row of the group) of M tile number `tile`."""
    offs_e = tl.arange(0, BLOCK_E)
    cnt = tl.load(cnt_ptr + offs_e, mask=offs_e < E, other=0)
    tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    cum_tiles = tl.cumsum(tiles, 0)
    e = tl.sum((cum_tiles <= tile).to(tl.int32), 0)  # groups whose tiles all come before
    before = offs_e < e
    row_start = tl.sum(tl.where(before, cnt, 0), 0)
    tiles_before = tl.sum(tl.where(before, tiles, 0), 0)
    row_end = row_start + tl.sum(tl.where(offs_e == e, cnt, 0), 0)
    return e, row_start + (tile - tiles_before) * BLOCK_M, row_end


@triton.jit
def gmm_kernel(
    a_ptr, b_ptr, y_ptr, cnt_ptr, E, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    e, row0, row_end = group_of_tile(cnt_ptr, tl.program_id(0), E, BLOCK_M, BLOCK_E)
    if e < E:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < row_end
        mask_n = offs_n < N
        a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
        b_cols = b_ptr + e.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(
                a_rows + offs_k[None, :] * stride_ak,
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            b = tl.load(
                b_cols + offs_k[:, None] * stride_bk,
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def wgrad_kernel(
    a_ptr, b_ptr, out_ptr, cnt_ptr, E, M, N,
    stride_as, stride_am, stride_bs, stride_bn, stride_oe, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tl.program_id(1) // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(1) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_e = tl.arange(0, BLOCK_E)
    cnt = tl.load(cnt_ptr + offs_e, mask=offs_e < E, other=0)
    start = tl.sum(tl.where(offs_e < e, cnt, 0), 0)
    end = start + tl.sum(tl.where(offs_e == e, cnt, 0), 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = (r0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        mask_r = rows < end
        a_t = tl.load(  # [BLOCK_M, BLOCK_K]: a_e^T
            a_ptr + rows[None, :] * stride_as + offs_m[:, None] * stride_am,
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rows[:, None] * stride_bs + offs_n[None, :] * stride_bn,
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc = tl.dot(a_t, b, acc, input_precision=PRECISION)
    o = (
        out_ptr
        + e.to(tl.int64) * stride_oe
        + offs_m[:, None] * stride_om
        + offs_n[None, :] * stride_on
    )
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def counts_tensor(counts, num_groups: int, device: torch.device) -> torch.Tensor:
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1 or counts.dtype.is_floating_point:
            raise TypeError("counts must be a 1-D integer tensor or a list of ints")
        cnt = counts.to(device=device, dtype=torch.int32)
    else:
        cnt = torch.tensor([int(c) for c in counts], dtype=torch.int32, device=device)
    if cnt.shape[0] != num_groups:
        raise ValueError(f"counts has {cnt.shape[0]} groups but the weight has {num_groups}")
    return cnt.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"  # ignored for 16-bit inputs


def _mm_config(a: torch.Tensor, num_groups: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Untuned defaults: results
    checked on an H200 at commit 5d8f939 (2026-11-30), speed never measured there."""
    if not a.is_cuda:  # interpreter (tests): small tiles so tiny shapes span several
        return 16, 32, 32, 1, 1
    block_m = 64 if a.shape[0] <= 64 * max(num_groups, 1) else 128
    block_k = 32 if a.dtype == torch.float32 else 64
    return block_m, 128, block_k, 8 if block_m == 128 else 4, 3


def grouped_mm(
    a_SK: torch.Tensor,
    b: torch.Tensor,
    counts,
    trans_b: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of group e times b[e]^T (trans_b, b [E, N, K]) or b[e] (b [E, K, N]) -> [S, N].

    counts: list of ints or a 1-D integer (device) tensor of rows per group; with a
    device tensor nothing is read on the host. `out` (optional, [S, N]) is written in place.
    The `GemmBackend.mm` of the "triton" backend.
    """
    if a_SK.dim() != 2 or b.dim() != 3:
        raise ValueError(
            f"a must be [S, K] and b [E, ., .], got {tuple(a_SK.shape)}, {tuple(b.shape)}"
        )
    E = b.shape[0]
    N, Kd = (b.shape[1], b.shape[2]) if trans_b else (b.shape[2], b.shape[1])
    if a_SK.shape[1] != Kd:
        raise ValueError(f"a has {a_SK.shape[1]} columns but b expects K={Kd} (trans_b={trans_b})")
    S = a_SK.shape[0]
    y = out if out is not None else a_SK.new_empty(S, N)
    if S == 0 or N == 0:
        return y
    if Kd == 0 or E == 0:
        return y.zero_()
    cnt = counts_tensor(counts, E, a_SK.device)
    bm, bn, bk, warps, stages = _mm_config(a_SK, E)
    stride_bk, stride_bn = (b.stride(2), b.stride(1)) if trans_b else (b.stride(1), b.stride(2))
    grid = (triton.cdiv(S, bm) + E, triton.cdiv(N, bn))
    gmm_kernel[grid](
        a_SK, b, y, cnt, E, N, Kd,
        a_SK.stride(0), a_SK.stride(1), b.stride(0), stride_bk, stride_bn,
        y.stride(0), y.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(E),
        PRECISION=dot_precision(a_SK.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def grouped_wgrad(a_SM: torch.Tensor, b_SN: torch.Tensor, counts) -> torch.Tensor:
    """out[e] = a_e^T @ b_e over the rows of group e -> [E, M, N] (zeros for an empty group).

    The `GemmBackend.wgrad` of the "triton" backend.
    """
    if a_SM.dim() != 2 or b_SN.dim() != 2 or a_SM.shape[0] != b_SN.shape[0]:
        raise ValueError(
            f"a and b must be [S, M] and [S, N], got {tuple(a_SM.shape)}, {tuple(b_SN.shape)}"
        )
    E = len(counts) if not isinstance(counts, torch.Tensor) else counts.shape[0]
    (S, M), N = a_SM.shape, b_SN.shape[1]
    out = a_SM.new_empty(E, M, N)
    if E == 0 or M == 0 or N == 0:
        return out
    if S == 0:
        return out.zero_()
    cnt = counts_tensor(counts, E, a_SM.device)
    if a_SM.is_cuda:
        bm, bn, bk = 128, 128, 32 if a_SM.dtype == torch.float32 else 64
        warps, stages = 8, 3
    else:
        bm, bn, bk, warps, stages = 16, 32, 16, 1, 1
    grid = (E, triton.cdiv(M, bm) * triton.cdiv(N, bn))
    wgrad_kernel[grid](
        a_SM, b_SN, out, cnt, E, M, N,
        a_SM.stride(0), a_SM.stride(1), b_SN.stride(0), b_SN.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(E),
        PRECISION=dot_precision(a_SM.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
