"""Top-k routing by its definition, the specification `route` and the routing kernels are
tested against (forward and backward; an fp64 gradcheck at tiny sizes).
"""

# T tokens, E experts, K top-k, G expert groups (n_group)

from __future__ import annotations

import torch

from ..specs import RoutingConfig, as_routing


def route_reference(
    logits_TE: torch.Tensor,
    top_k: int,
    routing: RoutingConfig | None = None,
    *,
    expert_bias_E: torch.Tensor | None = None,
    **fields,
):
    """Top-k routing. Returns (weights_TK, ids_TK int64, scores_TE), scores and weights in
    fp32 (fp64 for fp64 logits).

    `routing` (or its fields as keywords) says how. Scores are computed in fp32. The
    expert bias only changes which experts are chosen; the weights are the unbiased
    scores of the chosen experts. Group-limited selection (DeepSeek-V3): a group's
    score is the sum of its top-2 biased scores (top-1 when a group holds one expert);
    only the best `topk_group` groups compete.
    """
    routing = as_routing(routing, **fields)
    n_group, topk_group = routing.n_group, routing.topk_group
    T, E = logits_TE.shape
    scores_TE = scores_of(logits_TE, routing)
    choice_TE = (
        scores_TE if expert_bias_E is None else scores_TE + expert_bias_E.to(scores_TE.dtype)
    )
    if n_group is not None and n_group > 1:
        per = E // n_group
        grouped = choice_TE.view(T, n_group, per)
        group_scores = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, G]
        keep_groups = group_scores.topk(topk_group, dim=-1).indices
        # scatter_ of a scalar: no host index or host value copied to the device (no sync)
        mask = torch.zeros(T, n_group, dtype=torch.bool, device=logits_TE.device)
        mask.scatter_(1, keep_groups, True)
        mask_TE = mask.unsqueeze(-1).expand(T, n_group, per).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~mask_TE, float("-inf"))
    ids_TK = choice_TE.topk(top_k, dim=-1).indices
    return weights_of(scores_TE, ids_TK, routing), ids_TK, scores_TE


def scores_of(logits_TE: torch.Tensor, routing: RoutingConfig) -> torch.Tensor:
    """The routing scores [T, E]: softmax or sigmoid of the logits in fp32 at least (fp64
    stays fp64, for gradchecks)."""
    logits = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    return logits.softmax(dim=-1) if routing.score_func == "softmax" else logits.sigmoid()


def weights_of(scores_TE: torch.Tensor, ids_TK: torch.Tensor, routing: RoutingConfig):
    """The weights [T, K] of the chosen experts: their scores, renormalised to sum 1 when
    `routing.renormalize`, times the scaling factor."""
    weights_TK = scores_TE.gather(1, ids_TK)
    if routing.renormalize:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
    return weights_TK * routing.scaling_factor
