"""Grouped GEMMs that gather their rows and fuse the expert activation into the epilogue.

Rows are pairs sorted by expert (group e holds rows [off[e], off[e+1]), counts a device
tensor); `index_S` maps each sorted row to the row of the operand it reads (the pair's
token), so no [S, D] gathered copy is made. `up_act`: h = x[index] @ gate_up[e]^T with
the activation (`activation_kernels.glu_fwd`) x routing weight in the epilogue, writing h
and a (a tile computes the gate and the up columns of its F columns in two
accumulators). `down_dact`: da = dy[index] @ down[e] with the activation backward in the
epilogue: dh, the recomputed a, and per column tile a partial routing-weight gradient
summed over tiles afterwards in tile order (deterministic, no atomics).
`gathered_wgrad`: out[e] = A_e^T @ B_e with either operand's rows gathered in the K loop.

Persistent programs walk the tiles expert-major (programs running at one time share one
expert's weights in L2); an expert's last row tile runs BLOCK_M_TAIL rows when its rows
fit. Weights are read with masked `tl.load`, or on Hopper and newer through TMA tensor
descriptors (`_use_tma`), a path UNVERIFIED on hardware (it runs under the interpreter in
the tests). fp32 accumulation; the activation reads h rounded to its storage dtype, as the
unfused path does.
"""

# T tokens, D model dim, F expert hidden dim, E experts, S sorted pairs, N output columns,
# M wgrad rows, R rows of the operand a gather reads

# `# fmt: skip` below: a kernel's signature and its launches keep their arguments as a few
# lines of names (the formatter puts one per line, which makes each kernel a page of names)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import on_gpu
from ..activation.activation_kernels import glu, glu_fwd
from ..activation.swiglu_kernels import gate_up_cols
from ..grouped_gemm.gemm_kernels import counts_tensor, dot_precision, group_of_tile


@triton.jit
def _num_tiles(cnt_ptr, E, tiles_n, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    cnt = tl.load(cnt_ptr + offs_e, mask=offs_e < E, other=0)
    return tl.sum((cnt + BLOCK_M - 1) // BLOCK_M, 0) * tiles_n


@triton.jit
def _w_tile(w, e, n_idx, n0, k0, mask_n, K, stride_we, stride_wk, stride_wn,
            W_T: tl.constexpr, USE_TMA: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The [BLOCK_K, BLOCK_N] tile (k, n) of expert e's weight, k from k0: w[e, n, k]
    (W_T) or w[e, k, n]. TMA reads the contiguous columns [n0, n0 + BLOCK_N) (zero past
    the tensor's edge); the pointer path reads the columns n_idx."""
    if USE_TMA:
        if W_T:
            b = tl.trans(w.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K))
        else:
            b = w.load([e, k0, n0]).reshape(BLOCK_K, BLOCK_N)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ptr = w + e.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk
        b = tl.load(
            ptr + n_idx[None, :] * stride_wn,
            mask=(offs_k < K)[:, None] & mask_n[None, :],
            other=0.0,
        )
    return b


@triton.jit
def _row_index(idx_ptr, offs_m, mask_m, HAS_INDEX: tl.constexpr):
    """The operand row each sorted row reads: index[s] (a gather) or s itself."""
    if HAS_INDEX:
        rows = tl.load(idx_ptr + offs_m, mask=mask_m, other=0)
    else:
        rows = offs_m
    return rows.to(tl.int64)


@triton.jit
def _glu_gemm(a_ptr, idx_ptr, w, e, row0, row_end, f0, F, K, stride_ar, stride_ak,
              stride_we, stride_wk, stride_wn, GATE_UP: tl.constexpr, HAS_INDEX: tl.constexpr,
              INTERLEAVED: tl.constexpr, W_T: tl.constexpr, USE_TMA: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):  # fmt: skip
    """a[index[rows]] @ W over K for the columns [f0, f0 + BLOCK_N): with GATE_UP, the
    gate and the up columns of them (two accumulators), else the columns themselves
    (the second accumulator is unused)."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_end
    offs_f = f0 + tl.arange(0, BLOCK_N)
    mask_f = offs_f < F
    if GATE_UP:
        col_g, col_u = gate_up_cols(offs_f, F, INTERLEAVED)
    else:
        col_g, col_u = offs_f, offs_f
    a_rows = a_ptr + _row_index(idx_ptr, offs_m, mask_m, HAS_INDEX)[:, None] * stride_ar
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_rows + offs_k[None, :] * stride_ak,
            mask=mask_m[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )
        b = _w_tile(w, e, col_g, f0, k0, mask_f, K, stride_we, stride_wk, stride_wn,
                    W_T, USE_TMA, BLOCK_N, BLOCK_K)  # fmt: skip
        acc_g = tl.dot(a, b, acc_g, input_precision=PRECISION)
        if GATE_UP:
            b = _w_tile(w, e, col_u, F + f0, k0, mask_f, K, stride_we, stride_wk,
                        stride_wn, W_T, USE_TMA, BLOCK_N, BLOCK_K)  # fmt: skip
            acc_u = tl.dot(a, b, acc_u, input_precision=PRECISION)
    return acc_g, acc_u, offs_m, mask_m, offs_f, mask_f, col_g, col_u


# --- up projection + activation x prob ------------------------------------------------


@triton.jit
def _up_act_tile(x_ptr, idx_ptr, w, p_ptr, h_ptr, a_ptr, e, row0, row_end, f0, F, D,
                 stride_xt, stride_xd, stride_we, stride_wk, stride_wn, stride_h, stride_a,
                 alpha, limit, HAS_INDEX: tl.constexpr, HAS_P: tl.constexpr,
                 INTERLEAVED: tl.constexpr, W_T: tl.constexpr, USE_TMA: tl.constexpr,
                 KIND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    acc_g, acc_u, offs_m, mask_m, offs_f, mask_f, col_g, col_u = _glu_gemm(
        x_ptr, idx_ptr, w, e, row0, row_end, f0, F, D, stride_xt, stride_xd,
        stride_we, stride_wk, stride_wn, True, HAS_INDEX, INTERLEAVED, W_T, USE_TMA,
        PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    mask = mask_m[:, None] & mask_f[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    ty = h_ptr.dtype.element_ty
    gate, up = acc_g.to(ty), acc_u.to(ty)  # the activation reads h as stored
    tl.store(h_ptr + rows * stride_h + col_g[None, :], gate, mask=mask)
    tl.store(h_ptr + rows * stride_h + col_u[None, :], up, mask=mask)
    act = glu_fwd(gate.to(tl.float32), up.to(tl.float32), alpha, limit, KIND)
    if HAS_P:
        act = act * tl.load(p_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    tl.store(a_ptr + rows * stride_a + offs_f[None, :], act.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def up_act_kernel(x_ptr, idx_ptr, w, p_ptr, h_ptr, a_ptr, cnt_ptr, E, F, D,
                   stride_xt, stride_xd, stride_we, stride_wk, stride_wn, stride_h, stride_a,
                   alpha, limit, NUM_PROGS, HAS_INDEX: tl.constexpr, HAS_P: tl.constexpr,
                   INTERLEAVED: tl.constexpr, W_T: tl.constexpr, USE_TMA: tl.constexpr,
                   KIND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_M_TAIL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_E: tl.constexpr):  # fmt: skip
    tiles_n = tl.cdiv(F, BLOCK_N)
    total = _num_tiles(cnt_ptr, E, tiles_n, BLOCK_M, BLOCK_E)
    for tile in range(tl.program_id(0), total, NUM_PROGS):
        e, row0, row_end = group_of_tile(cnt_ptr, tile // tiles_n, E, BLOCK_M, BLOCK_E)
        f0 = (tile % tiles_n) * BLOCK_N
        if row_end - row0 <= BLOCK_M_TAIL:  # a short tail: the small tile
            _up_act_tile(x_ptr, idx_ptr, w, p_ptr, h_ptr, a_ptr, e, row0, row_end, f0, F, D,
                         stride_xt, stride_xd, stride_we, stride_wk, stride_wn, stride_h,
                         stride_a, alpha, limit, HAS_INDEX, HAS_P, INTERLEAVED, W_T, USE_TMA,
                         KIND, PRECISION, BLOCK_M_TAIL, BLOCK_N, BLOCK_K)  # fmt: skip
        else:
            _up_act_tile(x_ptr, idx_ptr, w, p_ptr, h_ptr, a_ptr, e, row0, row_end, f0, F, D,
                         stride_xt, stride_xd, stride_we, stride_wk, stride_wn, stride_h,
                         stride_a, alpha, limit, HAS_INDEX, HAS_P, INTERLEAVED, W_T, USE_TMA,
                         KIND, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip


# --- down projection's input gradient + activation backward ---------------------------


@triton.jit
def _dact_tile(g_ptr, idx_ptr, w, h_ptr, p_ptr, dh_ptr, gp_ptr, a_ptr, e, row0, row_end, f0,
               F, D, S, stride_gt, stride_gd, stride_we, stride_wk, stride_wn, stride_h,
               stride_dh, stride_a, alpha, limit, HAS_INDEX: tl.constexpr, HAS_P: tl.constexpr,
               NEED_GP: tl.constexpr, RECOMPUTE: tl.constexpr, INTERLEAVED: tl.constexpr,
               W_T: tl.constexpr, USE_TMA: tl.constexpr, KIND: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    da, _, offs_m, mask_m, offs_f, mask_f, _, _ = _glu_gemm(
        g_ptr, idx_ptr, w, e, row0, row_end, f0, F, D, stride_gt, stride_gd,
        stride_we, stride_wk, stride_wn, False, HAS_INDEX, INTERLEAVED, W_T, USE_TMA,
        PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    da = da.to(dh_ptr.dtype.element_ty).to(tl.float32)  # as the unfused path stores it
    mask = mask_m[:, None] & mask_f[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    col_g, col_u = gate_up_cols(offs_f, F, INTERLEAVED)
    gate = tl.load(h_ptr + rows * stride_h + col_g[None, :], mask=mask, other=0.0)
    up = tl.load(h_ptr + rows * stride_h + col_u[None, :], mask=mask, other=0.0)
    act, d_gate, d_up = glu(gate.to(tl.float32), up.to(tl.float32), alpha, limit, KIND)
    p = tl.full((BLOCK_M,), 1.0, tl.float32)
    if HAS_P:
        p = tl.load(p_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    if NEED_GP:  # this column tile's share of sum_f da * act
        part = tl.sum(tl.where(mask, da * act, 0.0), axis=1)
        tl.store(gp_ptr + (f0 // BLOCK_N).to(tl.int64) * S + offs_m, part, mask=mask_m)
    dap = da * p[:, None]
    ty = dh_ptr.dtype.element_ty
    tl.store(dh_ptr + rows * stride_dh + col_g[None, :], (dap * d_gate).to(ty), mask=mask)
    tl.store(dh_ptr + rows * stride_dh + col_u[None, :], (dap * d_up).to(ty), mask=mask)
    if RECOMPUTE:
        a = (act * p[:, None]).to(a_ptr.dtype.element_ty)
        tl.store(a_ptr + rows * stride_a + offs_f[None, :], a, mask=mask)


@triton.jit
def dact_kernel(g_ptr, idx_ptr, w, h_ptr, p_ptr, dh_ptr, gp_ptr, a_ptr, cnt_ptr, E, F, D, S,
                 stride_gt, stride_gd, stride_we, stride_wk, stride_wn, stride_h, stride_dh,
                 stride_a, alpha, limit, NUM_PROGS, HAS_INDEX: tl.constexpr,
                 HAS_P: tl.constexpr, NEED_GP: tl.constexpr, RECOMPUTE: tl.constexpr,
                 INTERLEAVED: tl.constexpr, W_T: tl.constexpr, USE_TMA: tl.constexpr,
                 KIND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_M_TAIL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_E: tl.constexpr):  # fmt: skip
    tiles_n = tl.cdiv(F, BLOCK_N)
    total = _num_tiles(cnt_ptr, E, tiles_n, BLOCK_M, BLOCK_E)
    for tile in range(tl.program_id(0), total, NUM_PROGS):
        e, row0, row_end = group_of_tile(cnt_ptr, tile // tiles_n, E, BLOCK_M, BLOCK_E)
        f0 = (tile % tiles_n) * BLOCK_N
        if row_end - row0 <= BLOCK_M_TAIL:
            _dact_tile(g_ptr, idx_ptr, w, h_ptr, p_ptr, dh_ptr, gp_ptr, a_ptr, e, row0, row_end,
                       f0, F, D, S, stride_gt, stride_gd, stride_we, stride_wk, stride_wn,
                       stride_h, stride_dh, stride_a, alpha, limit, HAS_INDEX, HAS_P, NEED_GP,
                       RECOMPUTE, INTERLEAVED, W_T, USE_TMA, KIND, PRECISION, BLOCK_M_TAIL,
                       BLOCK_N, BLOCK_K)  # fmt: skip
        else:
            _dact_tile(g_ptr, idx_ptr, w, h_ptr, p_ptr, dh_ptr, gp_ptr, a_ptr, e, row0, row_end,
                       f0, F, D, S, stride_gt, stride_gd, stride_we, stride_wk, stride_wn,
                       stride_h, stride_dh, stride_a, alpha, limit, HAS_INDEX, HAS_P, NEED_GP,
                       RECOMPUTE, INTERLEAVED, W_T, USE_TMA, KIND, PRECISION, BLOCK_M,
                       BLOCK_N, BLOCK_K)  # fmt: skip


# --- weight gradients over gathered rows ----------------------------------------------


@triton.jit
def wgrad_kernel(a_ptr, ia_ptr, b_ptr, ib_ptr, out_ptr, cnt_ptr, E, M, N,
                  stride_ar, stride_am, stride_br, stride_bn, stride_oe, stride_om, stride_on,
                  NUM_PROGS, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr,
                  PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_e = tl.cdiv(M, BLOCK_M) * tiles_n
    offs_e = tl.arange(0, BLOCK_E)
    cnt = tl.load(cnt_ptr + offs_e, mask=offs_e < E, other=0)
    for tile in range(tl.program_id(0), E * per_e, NUM_PROGS):  # expert-major
        e = tile // per_e
        offs_m = ((tile % per_e) // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        start = tl.sum(tl.where(offs_e < e, cnt, 0), 0)
        end = start + tl.sum(tl.where(offs_e == e, cnt, 0), 0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_K):
            offs_r = r0 + tl.arange(0, BLOCK_K)
            mask_r = offs_r < end
            ra = _row_index(ia_ptr, offs_r, mask_r, GATHER_A)
            rb = _row_index(ib_ptr, offs_r, mask_r, GATHER_B)
            a_t = tl.load(  # [BLOCK_M, BLOCK_K]: A_e^T
                a_ptr + ra[None, :] * stride_ar + offs_m[:, None] * stride_am,
                mask=mask_m[:, None] & mask_r[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + rb[:, None] * stride_br + offs_n[None, :] * stride_bn,
                mask=mask_r[:, None] & mask_n[None, :],
                other=0.0,
            )
            acc = tl.dot(a_t, b, acc, input_precision=PRECISION)
        o = out_ptr + e.to(tl.int64) * stride_oe + offs_m[:, None] * stride_om
        tl.store(
            o + offs_n[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


# --- launch ---------------------------------------------------------------------------


def _blocks(t: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_M_TAIL, BLOCK_N, BLOCK_K, num_warps, num_stages). Untuned GPU
    defaults (two accumulators of BM x BN fp32: 128 x 64 keeps them in registers);
    interpreter: small tiles so tiny shapes span several, partial and tail tiles."""
    if not on_gpu(t):
        return 16, 8, 16, 16, 1, 1
    return 128, 64, 64, 32 if t.dtype == torch.float32 else 64, 8, 3


def _num_programs(t: torch.Tensor, bound: int) -> int:
    """Persistent grid: one program per SM (capped by the tile bound); 3 under the
    interpreter, so the grid-stride loop runs more than once per program."""
    if not on_gpu(t):
        return max(1, min(3, bound))
    sms = torch.cuda.get_device_properties(t.device).multi_processor_count
    return max(1, min(sms, bound))


def _use_tma(w: torch.Tensor, interleaved: bool) -> bool:
    """TMA descriptors for the weight: Hopper or newer, a 16-byte aligned weight whose
    last dim is contiguous, the columns of one tile contiguous (not interleaved).
    UNVERIFIED on hardware (see the module docstring)."""
    if not w.is_cuda or interleaved or w.stride(-1) != 1:
        return False
    if torch.cuda.get_device_capability(w.device)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    size = w.element_size()
    return w.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in w.stride()[:-1])


def _weight_operand(w: torch.Tensor, w_t: bool, bn: int, bk: int, tma: bool):
    """(the kernel's weight argument, stride_e, stride_k, stride_n) for the (k, n) tile
    w[e, n, k] (w_t) or w[e, k, n]; a TMA descriptor over [E, ., .] when `tma`."""
    se, s1, s2 = w.stride()
    sk, sn = (s2, s1) if w_t else (s1, s2)
    if not tma:
        return w, se, sk, sn
    from triton.tools.tensor_descriptor import TensorDescriptor

    block = [1, bn, bk] if w_t else [1, bk, bn]
    return TensorDescriptor.from_tensor(w, block), se, sk, sn


def _index_arg(index: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    return fallback if index is None else index.contiguous()


def up_act(x, index_S, gate_up, counts, prob_S, trans_w, interleaved, activation, alpha, limit):
    """(h_S2F, a_SF): h = x[index] @ gate_up[e]^T (trans_w; gate_up [E, 2F, D]) or
    @ gate_up[e] ([E, D, 2F]) for the rows of expert e, a = act(gate, up) * prob.
    index_S: the row of x each sorted row reads (None: x is already sorted, [S, D]);
    counts: rows per expert (device tensor or list); raw, no autograd."""
    E = gate_up.shape[0]
    F2, D = (gate_up.shape[1], gate_up.shape[2]) if trans_w else gate_up.shape[:0:-1]
    S = index_S.shape[0] if index_S is not None else x.shape[0]
    F = F2 // 2
    h = x.new_empty(S, 2 * F)
    a = x.new_empty(S, F)
    if S == 0 or F == 0:
        return h, a
    cnt = counts_tensor(counts, E, x.device)
    bm, bmt, bn, bk, warps, stages = _blocks(x)
    tma = _use_tma(gate_up, interleaved)
    w, se, sk, sn = _weight_operand(gate_up, trans_w, bn, bk, tma)
    progs = _num_programs(x, (triton.cdiv(S, bm) + E) * triton.cdiv(F, bn))
    up_act_kernel[(progs,)](
        x, _index_arg(index_S, cnt), w, prob_S if prob_S is not None else x, h, a, cnt,
        E, F, D, x.stride(0), x.stride(1), se, sk, sn, h.stride(0), a.stride(0),
        float(alpha), float(limit), progs,
        HAS_INDEX=index_S is not None, HAS_P=prob_S is not None, INTERLEAVED=interleaved,
        W_T=trans_w, USE_TMA=tma, KIND=activation, PRECISION=dot_precision(x.dtype),
        BLOCK_M=bm, BLOCK_M_TAIL=bmt, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_E=triton.next_power_of_2(E), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return h, a


def down_dact(g, index_S, down, counts, h_S2F, prob_S, trans_w, interleaved, need_prob_grad,
              recompute, activation, alpha, limit):  # fmt: skip
    """(dh_S2F, d prob_S or None, a_SF or None) of the down projection's input gradient
    da = g[index] @ down[e] (trans_w: down [E, D, F]; else [E, F, D], da = g @ down[e]^T)
    through the activation: dh = da * prob * d act; d prob = sum_f da * act (combined
    over column tiles in a fixed order); a = act * prob when `recompute`. Raw."""
    E = down.shape[0]
    D, F = (down.shape[1], down.shape[2]) if trans_w else down.shape[:0:-1]
    S = h_S2F.shape[0]
    need_gp = prob_S is not None and need_prob_grad
    dh = h_S2F.new_empty(S, 2 * F)
    a = h_S2F.new_empty(S, F) if recompute else None
    bm, bmt, bn, bk, warps, stages = _blocks(g)
    tiles_n = triton.cdiv(F, bn) if F else 0
    gp = torch.zeros(tiles_n, S, dtype=torch.float32, device=g.device) if need_gp else None
    if S and F:
        cnt = counts_tensor(counts, E, g.device)
        tma = _use_tma(down, False)
        w, se, sk, sn = _weight_operand(down, not trans_w, bn, bk, tma)
        progs = _num_programs(g, (triton.cdiv(S, bm) + E) * tiles_n)
        dact_kernel[(progs,)](
            g, _index_arg(index_S, cnt), w, h_S2F, prob_S if prob_S is not None else h_S2F,
            dh, gp if need_gp else h_S2F, a if recompute else h_S2F, cnt, E, F, D, S,
            g.stride(0), g.stride(1), se, sk, sn, h_S2F.stride(0), dh.stride(0),
            a.stride(0) if recompute else 0, float(alpha), float(limit), progs,
            HAS_INDEX=index_S is not None, HAS_P=prob_S is not None, NEED_GP=need_gp,
            RECOMPUTE=recompute, INTERLEAVED=interleaved, W_T=not trans_w, USE_TMA=tma,
            KIND=activation, PRECISION=dot_precision(g.dtype), BLOCK_M=bm, BLOCK_M_TAIL=bmt,
            BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(E),
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    grad_p = gp.sum(0).to(prob_S.dtype) if need_gp else None  # tile order: deterministic
    return dh, grad_p, a


def gathered_wgrad(a, b, counts, index_a=None, index_b=None) -> torch.Tensor:
    """out[e] = A_e^T @ B_e -> [E, M, N], A = a[index_a] (or a) and B = b[index_b] (or
    b) over the sorted rows of expert e, the gathers read inside the K loop; zeros for
    an empty expert. Raw."""
    E = counts.shape[0] if isinstance(counts, torch.Tensor) else len(counts)
    M, N = a.shape[1], b.shape[1]
    S = index_a.shape[0] if index_a is not None else a.shape[0]
    out = a.new_empty(E, M, N)
    if E == 0 or M == 0 or N == 0:
        return out
    if S == 0:
        return out.zero_()
    cnt = counts_tensor(counts, E, a.device)
    if on_gpu(a):
        bm, bn, bk, warps, stages = 128, 128, 32 if a.dtype == torch.float32 else 64, 8, 3
    else:
        bm, bn, bk, warps, stages = 16, 32, 16, 1, 1
    total = E * triton.cdiv(M, bm) * triton.cdiv(N, bn)
    progs = _num_programs(a, total)
    wgrad_kernel[(progs,)](
        a, _index_arg(index_a, cnt), b, _index_arg(index_b, cnt), out, cnt, E, M, N,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2), progs,
        GATHER_A=index_a is not None, GATHER_B=index_b is not None,
        PRECISION=dot_precision(a.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_E=triton.next_power_of_2(E), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
