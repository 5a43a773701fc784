"""Routing as PyTorch custom ops (`dropless::route` and its backward): what
`torch.compile` and `torch.export` see of `route` and `route_with_aux`.

The node picks its implementation when it runs: a registered routing kernel ("triton"
on CUDA, registered then if this is the process's first CUDA routing) or the torch
reference, so a compiled CUDA region runs the routing kernel (Dynamo never traces the
registry). It returns route_with_aux's five outputs (weights_TK, ids_TK, scores_TE,
probs_mean_E, z_loss); the backward node takes the experts the forward chose: the
kernel's raw backward, or the vector-Jacobian product of the reference's scores and
weights at those experts (`torch.func.vjp`). The fake rule gives the shapes from the
operands. Under compile a checkpointed region is not replayed (docs/performance.md).
"""

# T tokens, E experts, K top-k

from __future__ import annotations

import torch
from torch import Tensor

from ..losses import mean_normalised_scores, z_loss
from ..specs import RoutingConfig
from .backends import route_kernels
from .reference import route_reference, scores_of, weights_of


def _routing(score_func, renormalize, scaling_factor, n_group, topk_group, expert_bias):
    grouped = n_group > 0
    return RoutingConfig(
        score_func, renormalize, scaling_factor, n_group if grouped else None,
        topk_group if grouped else None, expert_bias,
    )  # fmt: skip


def _acc(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


@torch.library.custom_op("dropless::route", mutates_args=())
def route_op(
    logits_TE: Tensor,
    expert_bias_E: Tensor | None,
    top_k: int,
    score_func: str,
    renormalize: bool,
    scaling_factor: float,
    n_group: int,
    topk_group: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(weights_TK, ids_TK int64, scores_TE, probs_mean_E, z_loss) of top-k routing, as
    `route_with_aux`; n_group 0: no group-limited selection."""
    args = (score_func, renormalize, scaling_factor, n_group, topk_group)
    routing = _routing(*args, expert_bias_E is not None)
    kernels = route_kernels(logits_TE, None)
    if kernels is not None and kernels.route_fwd is not None:
        w, ids, scores, psum, zsum = kernels.route_fwd(
            logits_TE, top_k, routing, expert_bias_E, stats=True
        )
        T = logits_TE.shape[0]  # T = 0: NaN means, as torch's
        return w, ids, scores, psum / T, zsum / T
    w, ids, scores = route_reference(logits_TE, top_k, routing, expert_bias_E=expert_bias_E)
    return w, ids, scores, mean_normalised_scores(scores), z_loss(logits_TE)


@route_op.register_fake
def _(logits_TE, expert_bias_E, top_k, score_func, renormalize, scaling_factor, n_group,
      topk_group):  # fmt: skip
    T, E = logits_TE.shape
    acc = dict(dtype=_acc(logits_TE))
    return (
        logits_TE.new_empty(T, top_k, **acc), logits_TE.new_empty(T, top_k, dtype=torch.int64),
        logits_TE.new_empty(T, E, **acc), logits_TE.new_empty(E, **acc),
        logits_TE.new_empty((), dtype=torch.float32),
    )  # fmt: skip


@torch.library.custom_op("dropless::route_backward", mutates_args=())
def route_backward_op(
    logits_TE: Tensor,
    ids_TK: Tensor,
    grad_w_TK: Tensor,
    grad_scores_TE: Tensor,
    grad_probs_mean_E: Tensor,
    grad_z: Tensor,
    score_func: str,
    renormalize: bool,
    scaling_factor: float,
) -> Tensor:
    """d loss / d logits_TE from the gradients of route_op's outputs, at the experts
    `ids_TK` the forward chose (the bias only selected them: it gets no gradient)."""
    routing = RoutingConfig(score_func, renormalize, scaling_factor)
    kernels = route_kernels(logits_TE, None)
    T = logits_TE.shape[0]
    if kernels is not None and kernels.route_bwd is not None:
        return kernels.route_bwd(
            logits_TE, ids_TK, grad_w_TK, grad_scores_TE, routing, grad_probs_mean_E / T,
            grad_z / T,
        )  # fmt: skip

    def outputs(logits):
        scores = scores_of(logits, routing)
        w = weights_of(scores, ids_TK, routing)
        return w, scores, mean_normalised_scores(scores), z_loss(logits)

    _, vjp = torch.func.vjp(outputs, logits_TE)
    return vjp((grad_w_TK, grad_scores_TE, grad_probs_mean_E, grad_z))[0]


@route_backward_op.register_fake
def _(logits_TE, ids_TK, grad_w_TK, grad_scores_TE, grad_probs_mean_E, grad_z, score_func,
      renormalize, scaling_factor):  # fmt: skip
    return torch.empty_like(logits_TE)


def _setup_context(ctx, inputs, output):
    logits_TE, _bias, _k, score_func, renormalize, scaling_factor = inputs[:6]
    ids_TK = output[1]
    ctx.save_for_backward(logits_TE, ids_TK)
    ctx.routing = (score_func, renormalize, scaling_factor)
    ctx.mark_non_differentiable(ids_TK)


def _backward(ctx, grad_w, _grad_ids, grad_scores, grad_probs_mean, grad_z):
    logits_TE, ids_TK = ctx.saved_tensors
    T, E = logits_TE.shape
    acc = _acc(logits_TE)
    grads = [  # an output no loss reads has no gradient: zeros of its shape
        g if g is not None else logits_TE.new_zeros(shape, dtype=dt)
        for g, shape, dt in (
            (grad_w, ids_TK.shape, acc), (grad_scores, (T, E), acc), (grad_probs_mean, (E,), acc),
            (grad_z, (), torch.float32),
        )
    ]  # fmt: skip
    dl = route_backward_op(logits_TE, ids_TK, *grads, *ctx.routing)
    return dl, None, None, None, None, None, None, None


torch.library.register_autograd("dropless::route", _backward, setup_context=_setup_context)


def run(logits_TE: Tensor, top_k: int, routing: RoutingConfig, expert_bias_E: Tensor | None):
    """route_with_aux's outputs through the custom op."""
    grouped = routing.n_group is not None and routing.n_group > 1
    return route_op(
        logits_TE, expert_bias_E, int(top_k), routing.score_func, bool(routing.renormalize),
        float(routing.scaling_factor), int(routing.n_group) if grouped else 0,
        int(routing.topk_group) if grouped else 0,
    )  # fmt: skip
