"""The routed expert MLP composed from ops: permute -> gate/up GEMM -> SwiGLU x prob ->
down GEMM -> combine. `grouped_mlp` works on tokens already in expert order (the
expert-parallel dispatcher calls it after its all-to-all); `expert_mlp` adds the local
permute and combine around it.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

from __future__ import annotations

import torch

from .dispatch import get_recipe, recipe_mlp
from .grouped_gemm import _expand_bias, grouped_gemm
from .permute import SortedPairs, permute, sort_by_expert, unpermute
from .swiglu import swiglu


def grouped_mlp(
    x_SD: torch.Tensor,
    counts,
    prob_S: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "swiglu",
    interleaved: bool = False,
    trans_w: bool = True,
    alpha: float = 1.702,
    limit: float = 7.0,
    backend: str | None = None,
) -> torch.Tensor:
    """Expert MLP on rows sorted by expert (`counts` rows each), scaled by prob_S.

    gate_up [E, 2F, D] and down [E, D, F] when trans_w (nn.Linear layout), else
    [E, D, 2F] and [E, F, D]. The prob scales the whole expert output, the down bias
    included: y = prob * (act @ down^T + b) = (prob * act) @ down^T + prob * b.
    """
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    recipe = get_recipe()
    fused = recipe_mlp(recipe) if recipe is not None else None
    if fused is not None:
        return fused(
            x_SD, counts, prob_S, gate_up, down, gate_up_bias=gate_up_bias, down_bias=down_bias,
            activation=activation, interleaved=interleaved, trans_w=trans_w, alpha=alpha,
            limit=limit, backend=backend, recipe=recipe,
        )
    h = grouped_gemm(x_SD, gate_up, counts, gate_up_bias, trans_w=trans_w, backend=backend)
    a = swiglu(h, prob_S, activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    y = grouped_gemm(a, down, counts, None, trans_w=trans_w, backend=backend)
    if down_bias is not None:
        b_SD = _expand_bias(down_bias, counts)
        y = y + (b_SD if prob_S is None else b_SD * prob_S.unsqueeze(1).to(b_SD.dtype))
    return y


def expert_mlp(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    keep_TK: torch.Tensor | None = None,
    **mlp_kwargs,
) -> tuple[torch.Tensor, SortedPairs]:
    """out[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t]); returns (out_TD, sorted pairs).

    Every pair is computed unless keep_TK (capacity mode) marks it dropped.
    """
    num_experts = gate_up.shape[0]
    sp = sort_by_expert(ids_TK, num_experts, keep_TK)
    x_SD = permute(x_TD, sp)
    prob_S = weights_TK.reshape(-1).index_select(0, sp.pair_S)
    y_SD = grouped_mlp(x_SD, sp.counts, prob_S, gate_up, down, **mlp_kwargs)
    return unpermute(y_SD, sp), sp
