"""The routed expert MLP by its definition (a loop over tokens and their experts): the
specification every expert path (loop, grouped, gathered, recipe) is tested against.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import torch

from ..activation.reference import swiglu_reference
from ..specs import ActivationConfig


def expert_mlp_reference(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up_E2FD: torch.Tensor,
    down_EDF: torch.Tensor,
    down_bias_ED: torch.Tensor | None = None,
    activation: ActivationConfig | str | None = None,
):
    """The routed expert MLP by its definition: a loop over tokens and their experts."""
    T, K = ids_TK.shape
    out = []
    for t in range(T):
        acc = x_TD.new_zeros(down_EDF.shape[1])
        for k in range(K):
            e = int(ids_TK[t, k])
            h = gate_up_E2FD[e] @ x_TD[t]
            a = swiglu_reference(h.unsqueeze(0), None, activation)[0]
            y = down_EDF[e] @ a
            if down_bias_ED is not None:
                y = y + down_bias_ED[e]
            acc = acc + weights_TK[t, k].to(x_TD.dtype) * y
        out.append(acc)
    return torch.stack(out)
