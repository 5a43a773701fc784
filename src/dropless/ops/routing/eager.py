"""Token-choice top-k routing and the capacity limit.

The routing math is `reference.route_reference` (already vectorised torch); this module
adds argument checks, the deterministic capacity rule and the choice of implementation:
a registered routing kernel (`backends.py`; "triton", `routing_kernels.py`: one kernel for
scores, groups, bias, top-k and weights, forward and backward, registered on the first
pick for a CUDA tensor) or the torch reference. Under `torch.compile` / `torch.export`
a call is one `dropless::route` node (`custom_op.py`), which picks when it runs.
"""

# T tokens, E experts, K top-k

from __future__ import annotations

import math

import torch

from ..losses import mean_normalised_scores, z_loss
from ..replay import checkpoint_state, remember
from ..specs import RoutingConfig, as_routing
from . import custom_op
from .backends import route_kernels
from .reference import route_reference


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
    backend: str | None = None,
):
    """Scores (fp32) -> top-k. Returns (weights_TK fp32, ids_TK int64, scores_TE fp32).

    `routing` (a `RoutingConfig`, or its fields as keywords, not both) says how.
    `expert_bias_E` [E] shifts selection, not the weights; it is required when
    `routing.expert_bias` is True and refused when it is False (the keyword form sets
    expert_bias from whether it is given).

    backend: None / "auto" (a registered routing kernel for CUDA logits, else the torch
    reference; in a checkpointed region both replay the forward's choice in the recompute,
    `ops.replay`), "reference", or a name of
    `routing_kernel_names()` (ValueError when it cannot run these logits).
    """
    routing = _checked(
        logits_TE, top_k, routing, expert_bias_E, score_func=score_func, renormalize=renormalize,
        scaling_factor=scaling_factor, n_group=n_group, topk_group=topk_group,
    )  # fmt: skip
    if backend in (None, "auto") and torch.compiler.is_compiling():  # one node
        return custom_op.run(logits_TE, top_k, routing, expert_bias_E)[:3]
    kernels = route_kernels(logits_TE, backend)
    if kernels is not None:
        return _replayable(kernels.route, logits_TE, top_k, routing, expert_bias_E)
    return route_reference(logits_TE, top_k, routing, expert_bias_E=expert_bias_E)


def route_with_aux(
    logits_TE: torch.Tensor,
    top_k: int,
    routing: RoutingConfig | None = None,
    *,
    expert_bias_E: torch.Tensor | None = None,
    backend: str | None = None,
):
    """`route` and the router losses' inputs from one pass over the same scores.

    Returns (weights_TK, ids_TK, scores_TE, probs_mean_E, z_loss): probs_mean_E [E] fp32
    is the mean over tokens of the scores normalised per token
    (`losses.mean_normalised_scores`), so that `losses.load_balancing_loss_from_mean(
    probs_mean_E, counts_E, n)` equals `losses.load_balancing_loss_global(scores_TE,
    counts_E, n)`, and z_loss is `losses.z_loss(logits_TE)`; both with gradients to the
    logits. A routing kernel ("triton", CUDA) computes them
    inside its routing pass and their gradients inside its backward; elsewhere they are
    the torch ops of `losses`. routing None: the defaults (`expert_bias` set when
    expert_bias_E is given); backend as in `route`.
    """
    routing = _checked(logits_TE, top_k, routing, expert_bias_E)
    if backend in (None, "auto") and torch.compiler.is_compiling():  # one node
        return custom_op.run(logits_TE, top_k, routing, expert_bias_E)
    kernels = route_kernels(logits_TE, backend)
    if kernels is not None and kernels.route_with_aux is not None:
        return _replayable(kernels.route_with_aux, logits_TE, top_k, routing, expert_bias_E)
    weights_TK, ids_TK, scores_TE = route(
        logits_TE, top_k, routing, expert_bias_E=expert_bias_E, backend=backend
    )
    return weights_TK, ids_TK, scores_TE, mean_normalised_scores(scores_TE), z_loss(logits_TE)


def _checked(logits_TE, top_k: int, routing, expert_bias_E, **fields) -> RoutingConfig:
    """The call's RoutingConfig (`routing`, or the keyword `fields`, with expert_bias set
    from whether expert_bias_E is given), checked against the logits and the bias."""
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits_TE.shape)}")
    bias = None if routing is not None else expert_bias_E is not None
    routing = as_routing(routing, expert_bias=bias, **fields)
    routing.check(logits_TE.shape[1], top_k)
    check_expert_bias(routing, expert_bias_E, logits_TE.shape[1])
    return routing


def _replayable(fn, logits_TE, top_k, routing, expert_bias_E):
    """fn(...) (a routing kernel); in the recompute of a checkpointed forward, fn at the
    experts that forward chose (`replay.remember`, per region in call order), as the
    torch path's replayed `torch.topk` does."""
    if checkpoint_state() is None:
        return fn(logits_TE, top_k, routing, expert_bias_E)
    forward = []

    def choose():
        forward.append(fn(logits_TE, top_k, routing, expert_bias_E))
        return forward[0][1].detach()

    ids_TK = remember("dropless.ops.route", choose)
    if forward:
        return forward[0]
    if tuple(ids_TK.shape) != (logits_TE.shape[0], top_k):
        raise RuntimeError(
            f"routing replay: the forward chose experts of shape {tuple(ids_TK.shape)}, the "
            f"recompute routes {(logits_TE.shape[0], top_k)}; the recompute saw other inputs"
        )
    return fn(logits_TE, top_k, routing, expert_bias_E, ids_TK=ids_TK)


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
