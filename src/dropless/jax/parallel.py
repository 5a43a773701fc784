"""Expert parallelism: experts sharded over a mesh axis, tokens moved by all-to-all.

Inside `jax.shard_map` each device routes its tokens, sorts the pairs by expert and sends
each peer the rows for its experts ("padded": one fixed-size `lax.all_to_all`, the XLA:CPU
path; "ragged": `lax.ragged_all_to_all`, unverified on GPU/TPU); the receiver regroups
them by local expert, runs the grouped expert MLP, and the results travel back. Dropless
by construction: the capacity is the worst case or a power-of-two bucket measured for the
batch (`ep_bucket`). Sizes and recompiles: docs/jax.md, "Expert parallelism".
"""

# T local tokens, D model dim, E experts, El local experts, K top-k, S local pairs (T*K),
# n devices on the axis, C capacity (rows per peer block, or receive rows when ragged),
# R rows of the regrouped buffer

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as Ps

from .gemm import MARGIN, varying_zeros
from .layer import (
    MoEAux,
    MoEConfig,
    expert_mlp_sorted,
    next_pow2,
    router_forward,
    shared_expert_forward,
)
from .permute import combine, permute, sort_by_expert
from .routing import load_balancing_loss_global, z_loss

EXCHANGES = ("padded", "ragged")


def _shard_map(f, mesh, in_specs, out_specs):
    sm = getattr(jax, "shard_map", None)
    if sm is None:  # older JAX
        from jax.experimental.shard_map import shard_map as sm
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def _excl(c, axis=-1):
    return jnp.cumsum(c, axis=axis) - c


def _regroup_index(recv_nEl, base_n, R):
    """Gather index putting received rows in local-expert order (source order within)."""
    n, El = recv_nEl.shape
    len_Q = recv_nEl.T.reshape(-1)  # segments in (local expert, source) order
    src_Q = (base_n[None, :] + _excl(recv_nEl, axis=1).T).reshape(-1)
    end_Q = jnp.cumsum(len_Q)
    i_R = jnp.arange(R, dtype=jnp.int32)
    q_R = jnp.minimum(jnp.searchsorted(end_Q, i_R, side="right"), n * El - 1)
    valid_R = i_R < end_Q[-1]
    idx_R = jnp.where(valid_R, src_Q[q_R] + i_R - (end_Q - len_Q)[q_R], 0)
    return idx_R.astype(jnp.int32), valid_R


def _ep_body(params, state, x_TD, *, cfg: MoEConfig, axis: str, n: int, C: int, exchange: str):
    T, D = x_TD.shape
    E, K = cfg.num_experts, cfg.top_k
    El, S = E // n, T * K
    logits_TE, weights_TK, ids_TK, scores_TE = router_forward(params, state, x_TD, cfg)
    sp = sort_by_expert(ids_TK, E, None, margin=0)
    x_SD = permute(x_TD, sp)
    prob_S = jnp.take(weights_TK.reshape(-1), sp.pair_P).astype(x_TD.dtype)
    counts_nEl = sp.counts_E.reshape(n, El)
    send_n = counts_nEl.sum(1)
    peer_off_n = _excl(send_n)
    recv_nEl = lax.all_to_all(counts_nEl, axis, 0, 0, tiled=True)  # row q: from source q
    peer_S = jnp.take(
        jnp.repeat(jnp.arange(n, dtype=jnp.int32), El), jnp.take(ids_TK.reshape(-1), sp.pair_P)
    )
    if exchange == "padded":
        c_C = jnp.arange(C, dtype=jnp.int32)
        ok_nC = c_C[None] < send_n[:, None]
        src_nC = jnp.where(ok_nC, peer_off_n[:, None] + c_C[None], 0).reshape(-1)
        keep = ok_nC.reshape(-1, 1)
        send_x = jnp.where(keep, jnp.take(x_SD, src_nC, axis=0), 0).reshape(n, C, D)
        send_p = jnp.where(keep[:, 0], jnp.take(prob_S, src_nC), 0).reshape(n, C)
        recv_x = lax.all_to_all(send_x, axis, 0, 0, tiled=True).reshape(n * C, D)
        recv_p = lax.all_to_all(send_p, axis, 0, 0, tiled=True).reshape(n * C)
        base_n = jnp.arange(n, dtype=jnp.int32) * C
        dropped = jnp.maximum(send_n - C, 0).sum()
    else:
        me = lax.axis_index(axis)
        all_send_nn = lax.all_gather(send_n, axis)  # [source, destination]
        out_off_n = _excl(all_send_nn, axis=0)[me]
        recv_n = all_send_nn[:, me]
        base_n = _excl(recv_n)
        rag = partial(lax.ragged_all_to_all, axis_name=axis)
        recv_x = rag(
            x_SD, varying_zeros((C, D), x_SD.dtype, x_SD), peer_off_n, send_n, out_off_n, recv_n
        )
        recv_p = rag(
            prob_S, varying_zeros((C,), prob_S.dtype, prob_S), peer_off_n, send_n, out_off_n, recv_n
        )
        dropped = jnp.maximum(recv_n.sum() - C, 0)
    R = recv_x.shape[0] + MARGIN
    idx_R, valid_R = _regroup_index(recv_nEl, base_n, R)
    x_RD = jnp.where(valid_R[:, None], jnp.take(recv_x, idx_R, axis=0), 0)
    p_R = jnp.where(valid_R, jnp.take(recv_p, idx_R), 0)
    y_RD = expert_mlp_sorted(x_RD, recv_nEl.sum(0), p_R, params["experts"], cfg.backend)
    # back to the receive layout: position of each received row in the regrouped buffer
    inv = (
        jnp.zeros(recv_x.shape[0], jnp.int32)
        .at[jnp.where(valid_R, idx_R, recv_x.shape[0])]
        .set(jnp.arange(R, dtype=jnp.int32), mode="drop")
    )
    y_back = jnp.take(y_RD, inv, axis=0)
    if exchange == "padded":
        ok = (jnp.arange(C)[None] < recv_nEl.sum(1)[:, None]).reshape(-1, 1)
        y_back = jnp.where(ok, y_back, 0).reshape(n, C, D)
        y_mine = lax.all_to_all(y_back, axis, 0, 0, tiled=True).reshape(n * C, D)
        r_S = jnp.arange(S, dtype=jnp.int32)
        y_SD = jnp.take(y_mine, peer_S * C + r_S - jnp.take(peer_off_n, peer_S), axis=0)
    else:
        # my rows sit in source q's sorted buffer at q's offset for me
        in_off_n = _excl(all_send_nn, axis=1)[:, me]
        y_SD = rag(
            y_back, varying_zeros((S, D), y_back.dtype, y_back), base_n, recv_n, in_off_n, send_n
        )
    out_TD = combine(y_SD, sp)
    if "shared_expert" in params:
        out_TD = out_TD + shared_expert_forward(params["shared_expert"], x_TD)
    counts_E = lax.psum(sp.counts_E, axis)
    aux = MoEAux(
        lb_loss=lax.pmean(load_balancing_loss_global(scores_TE, counts_E, T * n), axis),
        z_loss=lax.pmean(z_loss(logits_TE), axis),
        tokens_per_expert=counts_E,
        dropped=lax.psum(dropped, axis) + (T * n * K - counts_E.sum()),
        router_logits=logits_TE,
    )
    return out_TD, aux


def _in_specs(params: dict, state: dict, axis: str):
    """(params, state, x_TD): expert weights split by expert over `axis`, the tokens by
    token; everything else replicated."""
    specs = {}
    for k, v in params.items():
        spec = Ps(axis) if k == "experts" else Ps()
        specs[k] = jax.tree.map(lambda _, s=spec: s, v)
    return specs, jax.tree.map(lambda _: Ps(), state), Ps(axis)


def _check(cfg: MoEConfig, mesh, axis: str, x, exchange):
    if axis not in mesh.shape:
        raise ValueError(f"axis={axis!r} is not a mesh axis; the mesh has {tuple(mesh.shape)}")
    n = mesh.shape[axis]
    if cfg.num_experts % n:
        raise ValueError(
            f"num_experts={cfg.num_experts} must be divisible by the {axis!r} axis size {n}"
        )
    if x.shape[0] % n:
        raise ValueError(
            f"tokens x.shape[0]={x.shape[0]} must be divisible by the {axis!r} axis size {n}"
        )
    # ragged_all_to_all does not compile on XLA:CPU
    exchange = exchange or ("padded" if jax.default_backend() == "cpu" else "ragged")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r}; allowed: {EXCHANGES} or None (pick by platform)")
    return n, exchange


def moe_apply_ep(
    params: dict,
    x_TD,
    cfg: MoEConfig,
    mesh,
    *,
    axis: str = "ep",
    state: dict | None = None,
    capacity: int | None = None,
    exchange: str | None = None,
):
    """The MoE layer with experts sharded over mesh axis `axis`; returns (out_TD, MoEAux).

    x_TD [T, D] is split over `axis` by tokens; params["experts"] arrays are split over
    `axis` by expert (num_experts divisible by the axis size); router and shared
    expert are replicated. capacity: None for the worst case (always fits; jittable
    with no host sync), or an int from `ep_bucket` for this batch. exchange: "padded",
    "ragged" or None (by platform). Jit it with cfg, mesh, axis, capacity, exchange static.
    """
    n, exchange = _check(cfg, mesh, axis, x_TD, exchange)
    S = x_TD.shape[0] // n * cfg.top_k
    C = capacity if capacity is not None else (S if exchange == "padded" else n * S)
    state = state or {}
    body = partial(_ep_body, cfg=cfg, axis=axis, n=n, C=int(C), exchange=exchange)
    aux_specs = MoEAux(Ps(), Ps(), Ps(), Ps(), Ps(axis))
    f = _shard_map(body, mesh, _in_specs(params, state, axis), (Ps(axis), aux_specs))
    return f(params, state, x_TD)


def _need_body(params, state, x_TD, *, cfg, axis, n, exchange):
    _, _, ids_TK, _ = router_forward(params, state, x_TD, cfg)
    counts_nEl = jnp.bincount(ids_TK.reshape(-1), length=cfg.num_experts).reshape(n, -1)
    if exchange == "padded":
        need = counts_nEl.sum(1).max()
    else:
        need = lax.psum(counts_nEl.sum(1), axis)[lax.axis_index(axis)]
    return lax.pmax(need, axis)


@partial(jax.jit, static_argnames=("cfg", "mesh", "axis", "exchange"))
def _need(params, state, x_TD, cfg, mesh, axis, exchange):
    n = mesh.shape[axis]
    body = partial(_need_body, cfg=cfg, axis=axis, n=n, exchange=exchange)
    return _shard_map(body, mesh, _in_specs(params, state, axis), Ps())(params, state, x_TD)


def ep_bucket(
    params: dict,
    x_TD,
    cfg: MoEConfig,
    mesh,
    *,
    axis: str = "ep",
    state: dict | None = None,
    exchange: str | None = None,
    min_capacity: int = 8,
) -> int:
    """Smallest power-of-two capacity (>= min_capacity) that fits this batch's routing.

    Runs the router only (one host sync). Pass the result as `capacity` to
    `moe_apply_ep`: shapes then take at most log2(T_local*K) + 1 values.
    """
    n, exchange = _check(cfg, mesh, axis, x_TD, exchange)
    need = int(_need(params, state or {}, x_TD, cfg, mesh, axis, exchange))
    return max(next_pow2(need), min_capacity)
