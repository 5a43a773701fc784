"""The grouped GEMM by its definition (a loop over groups): the specification every
grouped-GEMM backend is tested against.
"""

# S rows, D input features, N output features, E groups (experts)

from __future__ import annotations

import torch


def grouped_gemm_reference(
    x_SD: torch.Tensor,
    w_END: torch.Tensor,
    counts_E,
    bias_EN: torch.Tensor | None = None,
    *,
    trans_w: bool = True,
):
    """y[s] = x[s] @ w[e(s)]^T (+ bias[e(s)]) for contiguous groups of counts_E rows.

    trans_w=True: w is [E, N, D] (nn.Linear layout); False: w is [E, D, N].
    """
    outs = []
    start = 0
    for e, n in enumerate([int(c) for c in counts_E]):
        w = w_END[e].t() if trans_w else w_END[e]
        y = x_SD[start : start + n] @ w
        if bias_EN is not None:
            y = y + bias_EN[e]
        outs.append(y)
        start += n
    return torch.cat(outs) if outs else x_SD.new_zeros(0, w_END.shape[1 if trans_w else 2])
