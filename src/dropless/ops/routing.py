"""Token-choice top-k routing, and the capacity limit kept for comparison runs.

The routing math is `reference.route_reference` (already vectorised torch); this module
adds argument checks and the deterministic capacity rule.
"""

# T tokens, E experts, K top-k

from __future__ import annotations

import math

import torch

from .reference import route_reference

SCORE_FUNCS = ("softmax", "sigmoid")


def check_routing_args(num_experts, top_k, score_func, n_group, topk_group) -> None:
    """Raise ValueError for an impossible routing configuration, naming the argument."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r}; allowed: {SCORE_FUNCS}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be an int in [1, num_experts={num_experts}]")
    if (n_group is None) != (topk_group is None):
        raise ValueError("n_group and topk_group go together: set both or neither")
    if n_group is not None:
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        if topk_group * (num_experts // n_group) < top_k:
            raise ValueError(
                f"topk_group={topk_group} groups of {num_experts // n_group} experts "
                f"hold fewer than top_k={top_k} experts"
            )


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    renormalize: bool = False,
    scaling_factor: float = 1.0,
    n_group: int | None = None,
    topk_group: int | None = None,
    expert_bias_E: torch.Tensor | None = None,
):
    """Scores (fp32) -> top-k. Returns (weights_TK fp32, ids_TK int64, scores_TE fp32).

    softmax or sigmoid scores; optional renormalisation of the top-k weights to sum 1;
    `scaling_factor` multiplies the weights; group-limited selection (DeepSeek-V3)
    with `n_group` / `topk_group`; `expert_bias_E` shifts selection, not the weights.
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits_TE.shape)}")
    check_routing_args(logits_TE.shape[1], top_k, score_func, n_group, topk_group)
    return route_reference(
        logits_TE,
        top_k,
        score_func=score_func,
        renormalize=renormalize,
        scaling_factor=scaling_factor,
        n_group=n_group,
        topk_group=topk_group,
        expert_bias_E=expert_bias_E,
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
