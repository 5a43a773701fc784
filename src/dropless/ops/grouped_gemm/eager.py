"""Grouped GEMM: y[s] = x[s] @ w[e(s)]^T for contiguous groups of rows, with autograd.

One autograd Function owns forward and backward (autograd through per-expert slices
builds a full-size zero gradient per expert: measured 10x slower); the raw products come
from a registered backend: `grouped_mm` (torch._grouped_mm where it is correct), `loop`
(per-expert torch.mm, everywhere, fp64 too) or `triton` (`gpu.py`).
"""

# S rows (sorted pairs), D in features, N out features, E groups (experts)

from __future__ import annotations

import functools

import torch

from ..compute_dtype import autocast_off
from ..permute.row_ops import pick_row_ops
from .backends import GemmBackend, pick_gemm_backend, register_gemm_backend


def _bounds(counts: list[int]):
    start = 0
    for e, n in enumerate(counts):
        yield e, start, start + n
        start += n


# --- loop backend -------------------------------------------------------------------


def _loop_mm(a_SK, b, counts, trans_b, out=None):
    n_out = b.shape[1] if trans_b else b.shape[2]
    y = out if out is not None else a_SK.new_empty(a_SK.shape[0], n_out)
    for e, lo, hi in _bounds(counts):
        if hi > lo:
            torch.mm(a_SK[lo:hi], b[e].t() if trans_b else b[e], out=y[lo:hi])
    return y


def _loop_wgrad(a_SM, b_SN, counts):
    out = a_SM.new_empty(len(counts), a_SM.shape[1], b_SN.shape[1])
    for e, lo, hi in _bounds(counts):
        if hi > lo:
            torch.mm(a_SM[lo:hi].t(), b_SN[lo:hi], out=out[e])
        else:
            out[e].zero_()
    return out


register_gemm_backend(
    GemmBackend("loop", _loop_mm, _loop_wgrad, supports=lambda a, b: True, priority=0)
)


# --- torch._grouped_mm backend ------------------------------------------------------
#
# CUDA's rules for torch._grouped_mm (aten/src/ATen/native/cuda/Blas.cpp and
# _meta_registrations.py, torch 2.11-2.13), which a CPU test checks every call against:
# bf16 operands (sm90+); each operand's leading stride a multiple of 16 bytes; offsets
# int32 cumulative ends. The grouped dimension must be the operand's outer (strided)
# one, so a group's slice starts 16-byte aligned whatever the group sizes: in
# 2D x 3D (forward, dgrad) `a` [S, K] is row-major; in 2D x 2D (wgrad) `a` [M, S] is
# column-major (a_SM.t()) and `b` [S, N] row-major. A row-major [M, S] `a` would need
# every group's row count to be a multiple of 8 (bf16), a device assert otherwise.


def group_offsets(counts, device) -> torch.Tensor:
    """End offset of each group as int32 on `device`. A device tensor of counts stays on
    the device (no host sync): this is what makes the grouped_mm path sync-free."""
    if isinstance(counts, torch.Tensor):
        return counts.to(device=device).cumsum(0, dtype=torch.int32)
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


def bind_offsets(be: GemmBackend, counts, offs=None, device=None) -> GemmBackend:
    """`be` with the groups' end offsets bound into its GEMMs when it takes them
    (`GemmBackend.offsets`), so the GEMMs of one layer share one offsets tensor: `offs`
    when the caller has it (`SortedPairs.offsets_E`), else computed here once from
    `counts` on `device`. Other backends are returned as they are."""
    if not be.offsets:
        return be
    if offs is None:
        offs = group_offsets(counts, device)
    mm, wgrad = functools.partial(be.mm, offs=offs), functools.partial(be.wgrad, offs=offs)
    return GemmBackend(be.name, mm, wgrad, be.supports, be.priority, be.device_counts)


def aligned_dims(t: torch.Tensor, *dims: int) -> bool:
    """Whether every dimension in `dims` spans a multiple of 16 bytes of t's dtype (what
    CUDA's grouped GEMMs need of every dimension they read as a row stride)."""
    align = max(1, 16 // t.element_size())
    return all(d % align == 0 for d in dims)


def _gmm_supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype or b.dim() not in (2, 3):
        return False
    if torch.compiler.is_compiling() and a.dtype != torch.bfloat16:
        return False  # its fake (meta) kernel accepts only bf16, whatever the device
    if a.device.type == "cpu":
        ok_dtype = a.dtype in (torch.float32, torch.bfloat16, torch.float16)
    elif a.device.type == "cuda":
        ok_dtype = a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device)[0] >= 9
    else:
        ok_dtype = False
    # every dimension the GEMMs read: a weight [E, ., .] -> both of its dims (forward,
    # dgrad and wgrad; the input's last dim is one of them); a wgrad's b [S, N] -> N (S
    # is the grouped dim, cut by the offsets)
    dims = (a.shape[-1], b.shape[-1]) + ((b.shape[-2],) if b.dim() == 3 else ())
    return ok_dtype and aligned_dims(a, *dims)


def _gmm_mm(a_SK, b, counts, trans_b, out=None, *, offs=None):
    S, N = a_SK.shape[0], (b.shape[1] if trans_b else b.shape[2])
    if S == 0:  # nothing to compute; the empty operand's strides are not CUDA-valid
        return out if out is not None else a_SK.new_empty(0, N)
    b_ekn = b.transpose(1, 2) if trans_b else b
    if offs is None:
        offs = group_offsets(counts, a_SK.device)
    y = torch._grouped_mm(a_SK.contiguous(), b_ekn, offs=offs)
    if out is not None:
        out.copy_(y)
        return out
    return y


def _gmm_wgrad(a_SM, b_SN, counts, *, offs=None):
    """out[e] = a_e^T b_e. a^T goes in column-major (a view, no [S, M] copy). offs: the
    groups' int32 end offsets when the caller has them (else computed from counts)."""
    E = counts.shape[0] if isinstance(counts, torch.Tensor) else len(counts)
    if a_SM.shape[0] == 0:  # no rows: every group is empty
        return a_SM.new_zeros(E, a_SM.shape[1], b_SN.shape[1])
    if offs is None:
        offs = group_offsets(counts, a_SM.device)
    out = torch._grouped_mm(a_SM.contiguous().t(), b_SN.contiguous(), offs=offs)
    # an empty group's block is not written by every kernel version: zero it on the device
    # (a Triton kernel on CUDA writes only those blocks; the eager form fills over all)
    empty_E = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
    return pick_row_ops(out).zero_groups(out, empty_E)


register_gemm_backend(
    GemmBackend(
        "grouped_mm",
        _gmm_mm,
        _gmm_wgrad,
        _gmm_supports,
        priority=10,
        device_counts=True,
        offsets=True,
    )
)


# --- autograd -----------------------------------------------------------------------


def bound_backend(x_SD, w, counts: list[int], offs, backend):
    """(backend, counts as it takes them): the picked backend with the groups' offsets
    bound in, and the counts on x's device for a backend that takes device counts (one
    host->device copy and one offsets tensor serve the forward and both backward GEMMs)."""
    be = pick_gemm_backend(backend, x_SD, w)
    cnt = torch.tensor(counts, device=x_SD.device) if be.device_counts else counts
    return bind_offsets(be, cnt, offs, x_SD.device), cnt


def gemm_forward(x_SD, w, bias_EN, counts: list[int], offs, trans_w: bool, backend):
    """(y, (backend, counts as it takes them)): the forward and what its backward reads
    beside x_SD and w (`gemm_backward`)."""
    be, cnt = bound_backend(x_SD, w, counts, offs, backend)
    y = be.mm(x_SD, w, cnt, trans_w)
    if bias_EN is not None:
        y += expand_bias(bias_EN, counts)
    return y, (be, cnt)


def gemm_backward(grad_SN, x_SD, w, bound, counts: list[int], trans_w: bool, needs) -> tuple:
    """(dx, dw, d bias) where `needs` (same order) wants them, else None."""
    be, cnt = bound
    grad_SN = grad_SN.contiguous()  # an expanded gradient (e.g. from .sum()) breaks gmm
    gx = gw = gb = None
    if needs[0]:
        # y = x w^T  ->  dx = dy w ;  y = x w  ->  dx = dy w^T
        gx = be.mm(grad_SN, w, cnt, not trans_w)
    if needs[1]:
        gw = be.wgrad(grad_SN, x_SD, cnt) if trans_w else be.wgrad(x_SD, grad_SN, cnt)
    if needs[2]:
        gb = group_sum(grad_SN, counts)
    return gx, gw, gb


class GroupedGemm(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, x_SD, w, bias_EN, counts, offs, trans_w, backend):
        y, ctx.bound = gemm_forward(x_SD, w, bias_EN, counts, offs, trans_w, backend)
        ctx.save_for_backward(x_SD, w)
        ctx.counts, ctx.trans_w, ctx.has_bias = counts, trans_w, bias_EN is not None
        return y

    @staticmethod
    @autocast_off
    def backward(ctx, grad_SN):
        x_SD, w = ctx.saved_tensors
        n = ctx.needs_input_grad
        needs = (n[0], n[1], ctx.has_bias and n[2])
        grads = gemm_backward(grad_SN, x_SD, w, ctx.bound, ctx.counts, ctx.trans_w, needs)
        return (*grads, None, None, None, None)


def expand_bias(bias_EN: torch.Tensor, counts, S: int | None = None) -> torch.Tensor:
    """bias_EN[e(s)] for every row s; counts a host list, or a device tensor with the
    row count S given (then nothing is read on the host)."""
    if not isinstance(counts, torch.Tensor):
        S, counts = sum(counts), torch.tensor(counts)
    return bias_EN.index_select(0, _group_of_rows(counts, S, bias_EN.device))


def _group_of_rows(counts: torch.Tensor, S: int, device) -> torch.Tensor:
    """[S]: the group of each row, on `device` (no host read)."""
    E = counts.numel()
    return torch.repeat_interleave(torch.arange(E, device=device), counts.to(device), output_size=S)


def group_sum(g_SN: torch.Tensor, counts) -> torch.Tensor:
    """Per-group row sums [E, N]; counts a host list or a device tensor (no sync)."""
    if isinstance(counts, torch.Tensor):
        e_S = _group_of_rows(counts, g_SN.shape[0], g_SN.device)
        return g_SN.new_zeros(counts.numel(), g_SN.shape[1]).index_add_(0, e_S, g_SN)
    out = g_SN.new_zeros(len(counts), g_SN.shape[1])
    for e, lo, hi in _bounds(counts):
        if hi > lo:
            torch.sum(g_SN[lo:hi], dim=0, out=out[e])
    return out


def check_counts(x_SD: torch.Tensor, w: torch.Tensor, counts) -> list[int]:
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1 or counts.dtype.is_floating_point:
            raise TypeError("counts must be a 1-D integer tensor or a list of ints")
        counts = counts.tolist()
    counts = [int(c) for c in counts]
    if len(counts) != w.shape[0]:
        raise ValueError(f"counts has {len(counts)} groups but the weight has {w.shape[0]}")
    if any(c < 0 for c in counts):
        raise ValueError(f"counts must be >= 0, got {counts}")
    if sum(counts) != x_SD.shape[0]:
        raise ValueError(f"counts sum to {sum(counts)} but x has {x_SD.shape[0]} rows")
    return counts
