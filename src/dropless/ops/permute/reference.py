"""Permute and combine by their definition (plain loops): the specification
`sort_by_expert`, `permute`, `unpermute` and the row kernels are tested against.
"""

# T tokens, D model dim, N features, E experts, K top-k, S sorted pairs

from __future__ import annotations

import torch


def permute_reference(x_TD: torch.Tensor, ids_TK: torch.Tensor, num_experts: int):
    """Gather tokens into expert order. Returns (x_SD, token_S, counts_E).

    Pairs are ordered by expert, and within an expert by (token, k): a stable sort of
    the flattened (token, k) pairs.
    """
    T, K = ids_TK.shape
    rows, tokens = [], []
    for e in range(num_experts):
        for t in range(T):
            for k in range(K):
                if int(ids_TK[t, k]) == e:
                    rows.append(x_TD[t])
                    tokens.append(t)
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=num_experts)
    token_S = torch.tensor(tokens, dtype=torch.long)
    x_SD = torch.stack(rows) if rows else x_TD.new_zeros(0, x_TD.shape[1])
    return x_SD, token_S, counts_E


def unpermute_reference(
    y_SN: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    num_experts: int,
):
    """Weighted sum back into token order: out[t] = sum_k w[t,k] * y[slot of (t,k)]."""
    T, K = ids_TK.shape
    slot = 0
    slot_of = {}
    for e in range(num_experts):
        for t in range(T):
            for k in range(K):
                if int(ids_TK[t, k]) == e:
                    slot_of[(t, k)] = slot
                    slot += 1
    out = []
    for t in range(T):
        acc = y_SN.new_zeros(y_SN.shape[1])
        for k in range(K):
            w = 1.0 if weights_TK is None else weights_TK[t, k].to(y_SN.dtype)
            acc = acc + w * y_SN[slot_of[(t, k)]]
        out.append(acc)
    return torch.stack(out)
