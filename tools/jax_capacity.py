"""The GShard/Switch dispatch-einsum MoE layer (capacity factor C per expert, the overflow
dropped) that `dropless bench jax` times beside `dropless.jax.moe_apply` as the row
`capacity_einsum`, run from a checkout (not in the wheel; `bench.common.from_checkout`)."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, C capacity per expert

from __future__ import annotations


def layer(E: int, K: int, F: int, C: int):
    """-> fwd(params, x_TD) -> (out_TD, dropped pairs), on `dropless.jax`'s parameters."""
    import jax
    import jax.numpy as jnp

    from dropless.jax import swiglu

    def fwd(p, x):
        T = x.shape[0]
        logits_TE = x @ p["router"]["weight"].T
        w_TK, ids_TK = jax.lax.top_k(jax.nn.softmax(logits_TE, -1), K)
        w_TK = w_TK / w_TK.sum(-1, keepdims=True)
        onehot_TKE = jax.nn.one_hot(ids_TK, E, dtype=jnp.int32)
        # position of each pair in its expert's queue, in (k, token) priority order
        pos_KTE = (
            jnp.cumsum(onehot_TKE.transpose(1, 0, 2).reshape(K * T, E), 0).reshape(K, T, E) - 1
        )
        pos_TK = (pos_KTE.transpose(1, 0, 2) * onehot_TKE).sum(-1)
        keep_TK = pos_TK < C
        slot_TKC = jax.nn.one_hot(jnp.where(keep_TK, pos_TK, C), C, dtype=x.dtype)
        dispatch_TEC = jnp.einsum("tke,tkc->tec", onehot_TKE.astype(x.dtype), slot_TKC)
        combine_TEC = jnp.einsum("tke,tkc,tk->tec", onehot_TKE.astype(x.dtype), slot_TKC, w_TK)
        x_ECD = jnp.einsum("tec,td->ecd", dispatch_TEC, x)
        h = jnp.einsum("ecd,efd->ecf", x_ECD, p["experts"]["gate_up_proj"])
        a = swiglu(h.reshape(E * C, 2 * F)).reshape(E, C, F)
        y_ECD = jnp.einsum("ecf,edf->ecd", a, p["experts"]["down_proj"])
        return jnp.einsum("tec,ecd->td", combine_TEC, y_ECD), T * K - keep_TK.sum()

    return fwd
