"""Sort (token, expert) pairs by expert, gather tokens into that order, and combine back.

Both directions are gathers: permute's backward and unpermute's forward are a
gather-and-sum over each token's K slots (never scatter-add with atomics), so the
same input gives the same bits on every backend.
"""

# T tokens, D model dim, N features, E experts, K top-k, S sorted (kept) pairs

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SortedPairs:
    """Where each (token, k) pair sits once the pairs are sorted by expert.

    token_S: the token of each slot; pair_S: its flat pair index t*K+k;
    slot_TK: the slot of each pair (S for a pair dropped by a capacity limit);
    counts_E: kept pairs per expert (device tensor); counts: the same on the host
    (None when sorted with host_counts=False: read counts_E instead).
    """

    token_S: torch.Tensor
    pair_S: torch.Tensor
    slot_TK: torch.Tensor
    counts_E: torch.Tensor
    counts: list[int] | None
    num_dropped: int = 0

    @property
    def num_slots(self) -> int:
        return int(self.token_S.shape[0])


def sort_by_expert(
    ids_TK: torch.Tensor,
    num_experts: int,
    keep_TK: torch.Tensor | None = None,
    *,
    host_counts: bool = True,
) -> SortedPairs:
    """Stable sort of the T*K pairs by expert id (ties keep (token, k) order).

    keep_TK (bool) marks pairs kept under a capacity limit; others are left out of the
    slots. The host copy of counts is the one device->host sync of a layer.
    host_counts=False (dropless only) skips it: `counts` is None and every shape is
    known without reading a device value, so the sort is sync-free (CUDA graphs,
    torch.compile without graph breaks); consumers then use `counts_E`.
    """
    T, K = ids_TK.shape
    flat = ids_TK.reshape(-1)
    if not host_counts:
        if keep_TK is not None:
            raise ValueError(
                "host_counts=False needs keep_TK=None: the dropped count is data-dependent"
            )
        return _sort_sync_free(flat, num_experts, T, K)
    if keep_TK is not None:
        # dropped pairs get the sentinel id E so they sort after every kept pair
        flat = torch.where(keep_TK.reshape(-1), flat, torch.full_like(flat, num_experts))
    order = torch.argsort(flat, stable=True)
    counts_all = torch.bincount(flat, minlength=num_experts + 1)
    counts_E = counts_all[:num_experts]
    counts = counts_E.tolist()  # host sync, once per layer
    S = sum(counts)
    pair_S = order[:S]
    slot_flat = torch.empty_like(order)
    slot_flat[order] = torch.arange(order.numel(), device=order.device)
    slot_flat = slot_flat.clamp_max(S)  # dropped pairs point one past the last slot
    return SortedPairs(
        token_S=pair_S // K,
        pair_S=pair_S,
        slot_TK=slot_flat.view(T, K),
        counts_E=counts_E,
        counts=counts,
        num_dropped=T * K - S,
    )


def _sort_sync_free(flat: torch.Tensor, num_experts: int, T: int, K: int) -> SortedPairs:
    order = torch.argsort(flat, stable=True)
    # index_add_ rather than bincount: bincount's output size depends on the data
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts_E.index_add_(0, flat, torch.ones_like(flat))
    slot_flat = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device)
    )
    return SortedPairs(
        token_S=order // K,
        pair_S=order,
        slot_TK=slot_flat.view(T, K),
        counts_E=counts_E,
        counts=None,
    )


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs (sums of K rows or N products), else the input's dtype."""
    return torch.promote_types(dtype, torch.float32)


def _padded(rows_SN: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """rows with one zero row appended when some slot points past the end (capacity
    mode only: in dropless mode S == T*K and nothing is read on the host)."""
    T, K = slot_TK.shape
    S, N = rows_SN.shape
    if S < T * K and bool((slot_TK >= S).any()):
        return torch.cat([rows_SN, rows_SN.new_zeros(1, N)])
    return rows_SN


def gather_sum(rows_SN: torch.Tensor, slot_TK: torch.Tensor, weights_TK=None) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * rows[slot[t,k]], rows past the end read as zero.

    Summed in k order in fp32 (16-bit inputs) and rounded once, one [T, N] gather at a
    time, so memory stays O(T*N). The eager `RowOps.gather_sum`.
    """
    T, K = slot_TK.shape
    N = rows_SN.shape[1]
    acc = _acc_dtype(rows_SN.dtype)
    rows_SN = _padded(rows_SN, slot_TK)
    out = None
    for k in range(K):
        part = rows_SN.index_select(0, slot_TK[:, k]).to(acc)
        if weights_TK is not None:
            part = part.mul_(weights_TK[:, k : k + 1].to(acc))
        out = part if out is None else out.add_(part)
    if out is None:
        return rows_SN.new_zeros(T, N)
    return out.to(rows_SN.dtype)


def gather_rows_eager(x_TD, index_S, scale=None, scale_index_S=None) -> torch.Tensor:
    """out[s] = x[index[s]] (* scale[scale_index[s]], scale read flat, product in fp32)."""
    out = x_TD.index_select(0, index_S)
    if scale is None:
        return out
    sidx = index_S if scale_index_S is None else scale_index_S
    s = scale.reshape(-1).index_select(0, sidx).to(_acc_dtype(x_TD.dtype)).unsqueeze(1)
    return (out.to(s.dtype) * s).to(x_TD.dtype)


def pair_dot_eager(g_TN: torch.Tensor, y_SN: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """dots[t,k] = <g[t], y[slot[t,k]]> in fp32 (fp64 for fp64), 0 where slot >= S."""
    acc = _acc_dtype(y_SN.dtype)
    y_SN = _padded(y_SN, slot_TK)
    g = g_TN.to(acc)
    cols = [
        torch.linalg.vecdot(g, y_SN.index_select(0, slot_TK[:, k]).to(acc))
        for k in range(slot_TK.shape[1])
    ]
    if not cols:
        return g.new_zeros(slot_TK.shape)
    return torch.stack(cols, 1)


class _Permute(torch.autograd.Function):
    """x_SD = x_TD[token_S]; backward gathers each token's K slots (no scatter)."""

    @staticmethod
    def forward(ctx, x_TD, token_S, slot_TK, impl):
        ctx.save_for_backward(slot_TK)
        ctx.impl = impl
        return impl.gather_rows(x_TD, token_S)

    @staticmethod
    def backward(ctx, grad_SD):
        (slot_TK,) = ctx.saved_tensors
        return ctx.impl.gather_sum(grad_SD.contiguous(), slot_TK), None, None, None


class _Unpermute(torch.autograd.Function):
    """out = sum_k w[t,k] y[slot[t,k]]; grads: grad_y[s] = w[pair_S[s]] g[token_S[s]],
    grad_w[t,k] = <g[t], y[slot[t,k]]>."""

    @staticmethod
    def forward(ctx, y_SN, weights_TK, token_S, pair_S, slot_TK, impl):
        ctx.save_for_backward(y_SN, weights_TK, token_S, pair_S, slot_TK)
        ctx.impl = impl
        return impl.gather_sum(y_SN, slot_TK, weights_TK)

    @staticmethod
    def backward(ctx, grad_TN):
        y_SN, weights_TK, token_S, pair_S, slot_TK = ctx.saved_tensors
        impl, grad_TN = ctx.impl, grad_TN.contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = impl.gather_rows(grad_TN, token_S, weights_TK, pair_S)
        if ctx.needs_input_grad[1]:
            grad_w = impl.pair_dot(grad_TN, y_SN, slot_TK).to(weights_TK.dtype)
        return grad_y, grad_w, None, None, None, None


class _UnpermuteUnweighted(torch.autograd.Function):
    """Unweighted combine: the transpose of permute (its backward is permute's forward)."""

    @staticmethod
    def forward(ctx, y_SN, token_S, slot_TK, impl):
        ctx.save_for_backward(token_S)
        ctx.impl = impl
        return impl.gather_sum(y_SN, slot_TK)

    @staticmethod
    def backward(ctx, grad_TN):
        (token_S,) = ctx.saved_tensors
        return ctx.impl.gather_rows(grad_TN.contiguous(), token_S), None, None, None


def _impl(t: torch.Tensor, impl):
    if impl is not None:
        return impl
    from .row_ops import pick_row_ops

    return pick_row_ops(t)


def permute(x_TD: torch.Tensor, sp: SortedPairs, *, impl=None) -> torch.Tensor:
    """Gather tokens into expert order: x_SD[s] = x_TD[token_S[s]].

    impl: a `row_ops.RowOps` (default: the best registered one for x's device)."""
    return _Permute.apply(x_TD, sp.token_S, sp.slot_TK, _impl(x_TD, impl))


def unpermute(
    y_SN: torch.Tensor, sp: SortedPairs, weights_TK: torch.Tensor | None = None, *, impl=None
) -> torch.Tensor:
    """Combine expert outputs back into token order, weighted by weights_TK (or 1)."""
    impl = _impl(y_SN, impl)
    if weights_TK is None:
        return _UnpermuteUnweighted.apply(y_SN, sp.token_S, sp.slot_TK, impl)
    return _Unpermute.apply(y_SN, weights_TK, sp.token_S, sp.pair_S, sp.slot_TK, impl)
