"""The eager (torch) forms of the row ops of the expert path: the gathers of permute and
combine, the pair dot of the combine's weight gradient and the zeroing of empty groups.

They are the "eager" `RowOps` of `row_ops.py` (the specification a kernel is tested
against): sums in k order in fp32 for 16-bit inputs, rounded once. The activation's eager
forms live with its math in `activation/eager.py`.
"""

# T tokens, S sorted pairs, N features, K top-k, E groups (experts)

from __future__ import annotations

import torch


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


def zero_groups_eager(out_EMN: torch.Tensor, empty_E: torch.Tensor) -> torch.Tensor:
    """out[e] = 0 where empty_E[e], in place: a masked fill over the whole tensor."""
    return out_EMN.masked_fill_(empty_E.view(-1, *[1] * (out_EMN.dim() - 1)), 0)
