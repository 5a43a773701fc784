"""SwiGLU with the routing weight folded in: silu(gate) * up * prob (custom VJP).

Saves only the GEMM output h and prob for backward (the activation is recomputed),
like the PyTorch op, so it costs no memory beyond the tensor it consumes.
"""

# S rows (sorted pairs), F expert hidden dim

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def _swiglu(h_S2F, prob_S):
    F = h_S2F.shape[-1] // 2
    gate, up = h_S2F[:, :F], h_S2F[:, F:]
    return jax.nn.silu(gate) * up * prob_S[:, None].astype(h_S2F.dtype)


def _fwd(h_S2F, prob_S):
    return _swiglu(h_S2F, prob_S), (h_S2F, prob_S)


def _bwd(res, g_SF):
    h_S2F, prob_S = res
    F = h_S2F.shape[-1] // 2
    gate, up = h_S2F[:, :F], h_S2F[:, F:]
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    d_prob = (g_SF * silu * up).sum(-1).astype(prob_S.dtype)
    g = g_SF * prob_S[:, None].astype(g_SF.dtype)
    d_gate = g * up * (sig * (1 + gate * (1 - sig)))
    return jnp.concatenate([d_gate, g * silu], axis=-1), d_prob


_swiglu.defvjp(_fwd, _bwd)


def swiglu(h_S2F: jax.Array, prob_S: jax.Array | None = None) -> jax.Array:
    """silu(gate) * up (* prob) per row: gate = columns [0, F), up = [F, 2F)."""
    if h_S2F.ndim != 2 or h_S2F.shape[-1] % 2:
        raise ValueError(f"h must be [S, 2F], got shape {h_S2F.shape}")
    if prob_S is None:
        prob_S = jnp.ones(h_S2F.shape[0], h_S2F.dtype)
    return _swiglu(h_S2F, prob_S)
