"""Token-choice top-k routing and router losses in JAX.

Same semantics as `dropless.ops.reference.route_reference` (the specification):
fp32 scores, the expert bias shifts selection but not the weights, group-limited
selection scores a group by the sum of its top-2 biased scores.
"""

# T tokens, E experts, K top-k, G expert groups (n_group)

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..ops.specs import RoutingConfig, as_routing


def route(
    logits_TE: jax.Array,
    top_k: int,
    routing: RoutingConfig | None = None,
    *,
    expert_bias_E: jax.Array | None = None,
    **routing_fields,
):
    """Scores (fp32) -> top-k. Returns (weights_TK fp32, ids_TK int32, scores_TE fp32).

    `routing` (a `RoutingConfig`, or its fields but expert_bias as keywords, not both) says how;
    `expert_bias_E` shifts the choice, not the weights (required when
    `routing.expert_bias`, refused otherwise).
    """
    if logits_TE.ndim != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    bias = None if routing is not None else expert_bias_E is not None
    routing = as_routing(routing, expert_bias=bias, **routing_fields)
    routing.check(E, top_k)
    routing.check_bias(expert_bias_E is not None)
    score_func, n_group, topk_group = routing.score_func, routing.n_group, routing.topk_group
    logits = logits_TE.astype(jnp.float32)
    scores_TE = (
        jax.nn.softmax(logits, axis=-1) if score_func == "softmax" else jax.nn.sigmoid(logits)
    )
    choice_TE = (
        scores_TE if expert_bias_E is None else scores_TE + expert_bias_E.astype(jnp.float32)
    )
    choice_TE = lax.stop_gradient(choice_TE)  # selection only: ids carry no gradient
    if n_group is not None and n_group > 1:
        per = E // n_group
        grouped = choice_TE.reshape(T, n_group, per)
        group_scores_TG = lax.top_k(grouped, min(2, per))[0].sum(-1)
        keep_TG = lax.top_k(group_scores_TG, topk_group)[1]
        mask_TG = jax.nn.one_hot(keep_TG, n_group, dtype=jnp.int32).sum(1) > 0
        mask_TE = jnp.repeat(mask_TG, per, axis=1)
        choice_TE = jnp.where(mask_TE, choice_TE, -jnp.inf)
    ids_TK = lax.top_k(choice_TE, top_k)[1].astype(jnp.int32)
    weights_TK = jnp.take_along_axis(scores_TE, ids_TK, axis=1)
    if routing.renormalize:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
    weights_TK = weights_TK * routing.scaling_factor
    return weights_TK, ids_TK, scores_TE


def load_balancing_loss_global(scores_TE: jax.Array, counts_E: jax.Array, num_tokens, mask_T=None):
    """Switch-style loss E * sum_e (c_e / T) * mean_t p[t, e] (as `dropless.ops`).

    counts_E and num_tokens come from the whole batch (summed over devices by the
    caller); the mean of the normalised scores is over this call's (unmasked) tokens.
    """
    E = scores_TE.shape[1]
    probs_TE = scores_TE / jnp.maximum(scores_TE.sum(-1, keepdims=True), 1e-20)
    if mask_T is None:
        mean_E = probs_TE.mean(0)
    else:
        m = mask_T.astype(probs_TE.dtype)[:, None]
        mean_E = (probs_TE * m).sum(0) / jnp.maximum(m.sum(), 1.0)
    frac_E = counts_E.astype(probs_TE.dtype) / jnp.maximum(num_tokens, 1)
    return E * (frac_E * mean_E).sum()


def z_loss(logits_TE: jax.Array, mask_T=None) -> jax.Array:
    """Router z-loss: mean over tokens of logsumexp(logits)^2 (fp32)."""
    lse_T = jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1) ** 2
    if mask_T is None:
        return lse_T.mean()
    m = mask_T.astype(jnp.float32)
    return (lse_T * m).sum() / jnp.maximum(m.sum(), 1.0)


def update_expert_bias(bias_E: jax.Array, counts_E: jax.Array, rate: float = 1e-3) -> jax.Array:
    """Aux-loss-free balancing: returns b + rate * sign(mean(c) - c) (functional)."""
    counts = counts_E.astype(jnp.float32)
    return bias_E + (rate * jnp.sign(counts.mean() - counts)).astype(bias_E.dtype)
