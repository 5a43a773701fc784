"""Sort (token, k) pairs by expert, gather rows into that order, and combine back.

Every pair is kept (dropless); the sorted buffer has T*K + MARGIN rows (the grouped GEMM's
spill). Pairs of masked tokens get the sentinel expert E and are never computed. Both
directions are gathers, backward too (custom VJPs), so no scatter-add over [T, D] appears.
"""

# T tokens, D model dim, N features, E experts, K top-k, P rows of the sorted buffer

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .gemm import MARGIN


class SortedPairs(NamedTuple):
    """Pairs in expert order. token_P/pair_P: source token and flat (t*K + k) pair of
    each row (0 on margin rows); slot_TK: row of each pair; counts_E: pairs per
    expert; valid_P: row holds a computed pair."""

    token_P: jax.Array
    pair_P: jax.Array
    slot_TK: jax.Array
    counts_E: jax.Array
    valid_P: jax.Array


def sort_by_expert(
    ids_TK: jax.Array, num_experts: int, mask_T: jax.Array | None = None, margin: int = MARGIN
):
    """Stable sort of the flattened pairs by expert id (ties keep (token, k) order)."""
    T, K = ids_TK.shape
    S = T * K
    ids_TK = ids_TK.astype(jnp.int32)
    if mask_T is not None:
        ids_TK = jnp.where(mask_T[:, None], ids_TK, num_experts)
    flat_S = ids_TK.reshape(-1)
    order_S = jnp.argsort(flat_S, stable=True).astype(jnp.int32)
    bounds = jnp.searchsorted(
        flat_S[order_S], jnp.arange(num_experts + 1, dtype=jnp.int32), side="left"
    )
    counts_E = jnp.diff(bounds).astype(jnp.int32)
    slot_S = jnp.zeros(S, jnp.int32).at[order_S].set(jnp.arange(S, dtype=jnp.int32))
    pair_P = jnp.concatenate([order_S, jnp.zeros(margin, jnp.int32)])
    valid_P = jnp.arange(S + margin) < bounds[num_experts]
    return SortedPairs(pair_P // K, pair_P, slot_S.reshape(T, K), counts_E, valid_P)


@jax.custom_vjp
def _permute(x_TD, token_P, slot_TK, valid_P):
    return jnp.take(x_TD, token_P, axis=0)


def _permute_fwd(x_TD, token_P, slot_TK, valid_P):
    return _permute(x_TD, token_P, slot_TK, valid_P), (slot_TK, valid_P)


def _permute_bwd(res, g_PD):
    slot_TK, valid_P = res
    g_PD = jnp.where(valid_P[:, None], g_PD, 0)
    return jnp.take(g_PD, slot_TK, axis=0).sum(1), None, None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def permute(x_TD: jax.Array, sp: SortedPairs) -> jax.Array:
    """x_PD[r] = x_TD[token of row r] (margin rows hold a copy of token 0)."""
    return _permute(x_TD, sp.token_P, sp.slot_TK, sp.valid_P)


@jax.custom_vjp
def _combine(y_PN, slot_TK, token_P, valid_P):
    return jnp.take(y_PN, slot_TK, axis=0).sum(1)


def _combine_fwd(y_PN, slot_TK, token_P, valid_P):
    return _combine(y_PN, slot_TK, token_P, valid_P), (token_P, valid_P)


def _combine_bwd(res, g_TN):
    token_P, valid_P = res
    return jnp.where(valid_P[:, None], jnp.take(g_TN, token_P, axis=0), 0), None, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(y_PN: jax.Array, sp: SortedPairs) -> jax.Array:
    """out[t] = sum_k y[row of (t, k)]: rows already carry their routing weight."""
    return _combine(y_PN, sp.slot_TK, sp.token_P, sp.valid_P)
