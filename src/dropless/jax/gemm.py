"""Grouped GEMM for rows sorted by expert: y[r] = x[r] @ w[e(r)]^T, with a custom VJP.

"tiled" (the default): a loop over experts covering each one's rows with chunks of `tile`
rows plus the binary decomposition of the remainder, forward, dgrad and wgrad alike
(nothing of size [E, S, N] exists); "ragged_dot": opt-in, XLA densifies it over all
experts (docs/jax.md). A last chunk may spill up to `min_chunk - 1` rows past its expert,
which the next expert overwrites: the buffer needs `MARGIN` rows after the last valid
row; wgrad masks the spill.
"""

# P rows of the sorted buffer (valid rows + margin), D in features, N out features, E experts

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

BACKENDS = ("tiled", "ragged_dot")
TILE = 512
MIN_CHUNK = 8
MARGIN = MIN_CHUNK  # rows the "tiled" backend needs after the last valid row


def _chunk_sizes(tile: int, min_chunk: int, rows: int) -> list[int]:
    """Chunk sizes tile, tile/2, ..., min_chunk; those longer than the buffer never run."""
    if tile < min_chunk or tile & (tile - 1) or min_chunk & (min_chunk - 1):
        raise ValueError(
            f"tile={tile} and min_chunk={min_chunk} must be powers of two, tile >= min_chunk"
        )
    if rows < min_chunk:
        raise ValueError(f"the buffer has {rows} rows, fewer than min_chunk={min_chunk}")
    sizes, s = [], tile
    while s >= min_chunk:
        if s <= rows:
            sizes.append(s)
        s //= 2
    return sizes


def _over_chunks(n, r0, sizes, body, carry):
    """body(carry, r, size) for chunks covering rows [r0, r0 + round_up(n, min_chunk))."""
    m = sizes[-1]
    n_r = (n + m - 1) // m * m

    def step(size):
        def f(_, c):
            c, r = c
            return body(c, r, size), r + size

        return f

    c = lax.fori_loop(0, n_r // sizes[0], step(sizes[0]), (carry, r0))
    for s in sizes[1:]:
        c = lax.fori_loop(0, (n_r // s) % 2, step(s), c)
    return c[0]


def varying_zeros(shape, dtype, *refs):
    """Zeros typed like `refs` under shard_map (varying over the same mesh axes), so a
    loop carry initialised with them keeps one type."""
    z = jnp.zeros(shape, dtype)
    for r in refs:
        z = z + jnp.zeros_like(r.reshape(-1)[:1], dtype=dtype)
    return z


def _offsets(counts_E):
    counts_E = counts_E.astype(jnp.int32)
    return counts_E, jnp.cumsum(counts_E) - counts_E


def _tiled_mm(x_PD, w_E__, counts_E, contract: int, tile: int, min_chunk: int):
    """y[r] = x[r] . w[e] contracting x's dim 1 with w[e]'s dim `contract`."""
    sizes = _chunk_sizes(tile, min_chunk, x_PD.shape[0])
    counts_E, offs_E = _offsets(counts_E)
    N = w_E__.shape[2 - contract]
    dims = (((1,), (contract,)), ((), ()))

    def expert(e, y):
        w = lax.dynamic_index_in_dim(w_E__, e, keepdims=False)

        def body(y, r, size):
            ys = lax.dot_general(lax.dynamic_slice_in_dim(x_PD, r, size), w, dims)
            return lax.dynamic_update_slice_in_dim(y, ys.astype(y.dtype), r, 0)

        return _over_chunks(counts_E[e], offs_E[e], sizes, body, y)

    y = varying_zeros((x_PD.shape[0], N), x_PD.dtype, x_PD, w_E__)
    return lax.fori_loop(0, w_E__.shape[0], expert, y)


def _tiled_wgrad(a_PA, b_PB, counts_E, tile: int, min_chunk: int):
    """dw[e] = a_e^T @ b_e over each expert's rows: [E, A, B] (spilled rows masked)."""
    sizes = _chunk_sizes(tile, min_chunk, a_PA.shape[0])
    counts_E, offs_E = _offsets(counts_E)
    E, A, B = counts_E.shape[0], a_PA.shape[1], b_PB.shape[1]
    dims = (((0,), (0,)), ((), ()))

    def expert(e, dw):
        end = offs_E[e] + counts_E[e]

        def body(acc, r, size):
            a = lax.dynamic_slice_in_dim(a_PA, r, size)
            keep = (r + jnp.arange(size) < end)[:, None]
            a = jnp.where(keep, a, 0)
            return acc + lax.dot_general(a, lax.dynamic_slice_in_dim(b_PB, r, size), dims)

        acc = _over_chunks(
            counts_E[e], offs_E[e], sizes, body, varying_zeros((A, B), jnp.float32, a_PA, b_PB)
        )
        return lax.dynamic_update_index_in_dim(dw, acc.astype(dw.dtype), e, 0)

    return lax.fori_loop(0, E, expert, varying_zeros((E, A, B), a_PA.dtype, a_PA, b_PB))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _tiled(x_PD, w, counts_E, trans_w: bool, tile: int, min_chunk: int):
    return _tiled_mm(x_PD, w, counts_E, 1 if trans_w else 0, tile, min_chunk)


def _tiled_fwd(x_PD, w, counts_E, trans_w, tile, min_chunk):
    return _tiled(x_PD, w, counts_E, trans_w, tile, min_chunk), (x_PD, w, counts_E)


def _tiled_bwd(trans_w, tile, min_chunk, res, g_PN):
    x_PD, w, counts_E = res
    # y = x @ w[e]^T (w [E, N, D]) -> dx = g @ w[e]; y = x @ w[e] (w [E, D, N]) -> dx = g @ w[e]^T
    dx = _tiled_mm(g_PN, w, counts_E, 0 if trans_w else 1, tile, min_chunk)
    if trans_w:
        dw = _tiled_wgrad(g_PN, x_PD, counts_E, tile, min_chunk)
    else:
        dw = _tiled_wgrad(x_PD, g_PN, counts_E, tile, min_chunk)
    return dx.astype(x_PD.dtype), dw.astype(w.dtype), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def grouped_gemm(
    x_PD: jax.Array,
    w: jax.Array,
    counts_E: jax.Array,
    *,
    trans_w: bool = True,
    backend: str | None = None,
    tile: int = TILE,
    min_chunk: int = MIN_CHUNK,
    has_margin: bool = False,
) -> jax.Array:
    """Rows grouped by expert (counts_E rows each, in order) times their expert's weight.

    w is [E, N, D] when `trans_w` (y = x @ w[e]^T, the nn.Linear layout), else [E, D, N].
    Rows past sum(counts_E) come back as zeros. backend: "tiled" (None: the default) or
    "ragged_dot". `has_margin=True` promises `MARGIN` spare rows after the last valid
    row (the layer allocates them) and saves the "tiled" backend a padded copy; the
    rows past sum(counts_E) are then unspecified.
    """
    backend = backend or "tiled"  # every platform: XLA densifies ragged_dot over all experts
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {BACKENDS} or None (tiled)")
    if x_PD.ndim != 2 or w.ndim != 3:
        raise ValueError(f"x must be [rows, in] and w [E, out, in]; got {x_PD.shape} and {w.shape}")
    if x_PD.shape[1] != w.shape[2 if trans_w else 1]:
        raise ValueError(
            f"x {x_PD.shape} and w {w.shape} disagree on the in dim (trans_w={trans_w})"
        )
    if counts_E.shape != (w.shape[0],):
        raise ValueError(f"counts_E must be [E={w.shape[0]}], got {counts_E.shape}")
    counts_E = counts_E.astype(jnp.int32)
    if backend == "ragged_dot":
        rhs = jnp.swapaxes(w, 1, 2) if trans_w else w
        return lax.ragged_dot(x_PD, rhs, counts_E)
    if has_margin:
        return _tiled(x_PD, w, counts_E, trans_w, tile, min_chunk)
    P = x_PD.shape[0]
    y = _tiled(jnp.pad(x_PD, ((0, min_chunk), (0, 0))), w, counts_E, trans_w, tile, min_chunk)
    valid = (jnp.arange(P) < counts_E.sum())[:, None]
    return jnp.where(valid, y[:P], 0)
