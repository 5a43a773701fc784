"""Token-choice top-k routing, and the capacity limit kept for comparison runs.

The routing math is `reference.route_reference` (already vectorised torch); this module
adds argument checks and the deterministic capacity rule.
"""

# T tokens, E experts, K top-k

from __future__ import annotations

import math

import torch

from .reference import route_reference
from .specs import RoutingConfig, as_routing


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    routing: RoutingConfig | None = None,
    *,
    expert_bias_E: torch.Tensor | None = None,
    score_func: str | None = None,
    renormalize: bool | None = None,
    scaling_factor: float | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
):
    """Scores (fp32) -> top-k. Returns (weights_TK fp32, ids_TK int64, scores_TE fp32).

    `routing` (a `RoutingConfig`) says how: softmax or sigmoid scores, optional
    renormalisation of the top-k weights to sum 1, a scaling factor, group-limited
    selection (DeepSeek-V3). The keywords `score_func`, `renormalize`,
    `scaling_factor`, `n_group`, `topk_group` are the same fields, for calls without
    a config (not both). `expert_bias_E` [E] shifts selection, not the weights; it is
    required when `routing.expert_bias` is True and refused when it is False (the
    keyword form sets expert_bias from whether it is given).
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits_TE.shape)}")
    routing = as_routing(
        routing,
        score_func=score_func,
        renormalize=renormalize,
        scaling_factor=scaling_factor,
        n_group=n_group,
        topk_group=topk_group,
        expert_bias=None if routing is not None else expert_bias_E is not None,
    )
    routing.check(logits_TE.shape[1], top_k)
    check_expert_bias(routing, expert_bias_E, logits_TE.shape[1])
    return route_reference(logits_TE, top_k, routing, expert_bias_E=expert_bias_E)


def check_expert_bias(routing: RoutingConfig, expert_bias_E, num_experts: int) -> None:
    """Raise ValueError when the bias given disagrees with `routing.expert_bias`."""
    routing.check_bias(expert_bias_E is not None)
    if expert_bias_E is not None and tuple(expert_bias_E.shape) != (num_experts,):
        raise ValueError(
            f"expert_bias_E must be [E={num_experts}], got shape {tuple(expert_bias_E.shape)}"
        )


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Pairs an expert may take: ceil(capacity_factor * T * K / E)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def capacity_keep_mask(
    ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """Which pairs an expert keeps under `capacity`: its highest-weight pairs.

    Overflow drops the lowest routing weight first; equal weights keep the earlier
    (token, k) pair, so the choice is deterministic.
    """
    flat_ids = ids_TK.reshape(-1)
    flat_w = weights_TK.detach().reshape(-1).float()
    by_weight = torch.argsort(-flat_w, stable=True)
    order = by_weight[torch.argsort(flat_ids[by_weight], stable=True)]
    counts = torch.bincount(flat_ids, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(order.numel(), device=ids_TK.device) - starts[flat_ids[order]]
    keep = torch.empty_like(flat_ids, dtype=torch.bool)
    keep[order] = rank_sorted < capacity
    return keep.view_as(ids_TK)
