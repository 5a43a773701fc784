"""Sort (token, expert) pairs by expert, gather tokens into that order, and combine back.

Both directions are gathers: permute's backward and unpermute's forward are a
gather-and-sum over each token's K slots (never scatter-add with atomics), so the
same input gives the same bits on every backend.
"""

# T tokens, D model dim, N features, E experts, K top-k, S sorted (kept) pairs

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..routing.backends import pick_routing_kernels
from .eager_rows import gather_sum
from .row_ops import pick_row_ops

__all__ = ["SortedPairs", "gather_sum", "permute", "sort_by_expert", "unpermute"]


@dataclass
class SortedPairs:
    """Where each (token, k) pair sits once the pairs are sorted by expert.

    token_S: the token of each slot; pair_S: its flat pair index t*K+k;
    slot_TK: the slot of each pair (S for a pair dropped by a capacity limit);
    counts_E: kept pairs per expert (device tensor); counts: the same on the host
    (None when sorted with host_counts=False: read counts_E instead). offsets_E: int32
    cumulative ends of counts_E (expert e holds slots [offsets_E[e] - counts_E[e],
    offsets_E[e])), the `offs` of `torch._grouped_mm`, computed once per layer.
    The index tensors are int64 from the torch sort and int32 from a routing kernel
    (`ops.routing.register_routing_kernels`; CUDA).
    """

    token_S: torch.Tensor
    pair_S: torch.Tensor
    slot_TK: torch.Tensor
    counts_E: torch.Tensor
    counts: list[int] | None
    num_dropped: int = 0
    offsets_E: torch.Tensor | None = None

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
    """Stable sort of the T*K pairs by expert id (ties keep (token, k) order), by the
    routing kernel that runs ids_TK (none under torch.compile) or the torch sort.

    keep_TK (bool) marks pairs kept under a capacity limit; others are left out of the
    slots. The host copy of counts is the one device->host sync of a layer.
    host_counts=False (dropless only) skips it: `counts` is None and every shape is
    known without reading a device value, so the sort is sync-free (CUDA graphs,
    torch.compile without graph breaks); consumers then use `counts_E`.
    """
    _check_host_counts(keep_TK, host_counts)
    kernels = pick_routing_kernels(ids_TK)
    sort = torch_sort_by_expert if kernels is None else kernels.sort_by_expert
    return sort(ids_TK, num_experts, keep_TK, host_counts=host_counts)


def _check_host_counts(keep_TK, host_counts: bool) -> None:
    if not host_counts and keep_TK is not None:
        raise ValueError(
            "host_counts=False needs keep_TK=None: the dropped count is data-dependent"
        )


def torch_sort_by_expert(
    ids_TK: torch.Tensor,
    num_experts: int,
    keep_TK: torch.Tensor | None = None,
    *,
    host_counts: bool = True,
) -> SortedPairs:
    """`sort_by_expert` by torch ops (argsort, bincount), on any device."""
    _check_host_counts(keep_TK, host_counts)
    T, K = ids_TK.shape
    flat = ids_TK.reshape(-1)
    if not host_counts:
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
        offsets_E=counts_E.cumsum(0, dtype=torch.int32),
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
        offsets_E=counts_E.cumsum(0, dtype=torch.int32),
    )


class Permute(torch.autograd.Function):
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


class Unpermute(torch.autograd.Function):
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


class UnpermuteUnweighted(torch.autograd.Function):
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
    return impl if impl is not None else pick_row_ops(t)


def permute(x_TD: torch.Tensor, sp: SortedPairs, *, impl=None) -> torch.Tensor:
    """Gather tokens into expert order: x_SD[s] = x_TD[token_S[s]].

    impl: a `row_ops.RowOps` (default: the best registered one for x's device)."""
    return Permute.apply(x_TD, sp.token_S, sp.slot_TK, _impl(x_TD, impl))


def unpermute(
    y_SN: torch.Tensor, sp: SortedPairs, weights_TK: torch.Tensor | None = None, *, impl=None
) -> torch.Tensor:
    """Combine expert outputs back into token order, weighted by weights_TK (or 1)."""
    impl = _impl(y_SN, impl)
    if weights_TK is None:
        return UnpermuteUnweighted.apply(y_SN, sp.token_S, sp.slot_TK, impl)
    return Unpermute.apply(y_SN, weights_TK, sp.token_S, sp.pair_S, sp.slot_TK, impl)
