"""Causal attention across the context-parallel ranks: all-gather K/V.

Each cp rank holds chunks r and 2*cp-1-r of the sequence (`sharding.py`).
`all_gather_sequence` gathers K and V into sequence order (backward: reduce-scatter), then
the local queries attend to the whole K/V under the causal mask of their global positions
(`attend_gathered`: blockwise on CPU, else SDPA with a bottom-right causal mask).
`reference_attention` is the specification (docs/parallel.md, "Context parallelism").
torch's own experimental context_parallel (ring attention on CUDA/NCCL) is not used: this
one works on every backend with all_gather.
"""

# B batch, H query heads, G key/value heads, S local length (2 C), C chunk length,
# L global length (cp x S), D head dim

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .blockwise import chunked_causal_attention
from .sharding import unshard_sequence


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _to_rank_order(x: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Sequence order -> the ranks' local tensors concatenated in rank order."""
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([t for r in range(cp) for t in (chunks[r], chunks[2 * cp - 1 - r])], dim)


class _AllGatherSequence(torch.autograd.Function):
    """Forward: all-gather along `dim` into sequence order. Backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        cp, _ = _world(group)
        ctx.group, ctx.dim, ctx.cp = group, dim, cp
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x, group=group)
        return unshard_sequence(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        group, dim, cp = ctx.group, ctx.dim, ctx.cp
        _, rank = _world(group)
        if dist.get_backend(group) == "gloo":
            # gloo has no reduce-scatter: reduce each rank's two chunks onto it, one rank's
            # at a time, so no copy of the whole sequence's gradient is made
            chunks = grad.chunk(2 * cp, dim)
            for r in range(cp):
                block = torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim)
                dist.reduce(block, dst=dist.get_global_rank(group, r), group=group)
                if r == rank:
                    out = block
            return out, None, None
        # rank-ordered along dim 0, so each rank's slice is one contiguous block
        send = _to_rank_order(grad, cp, dim).movedim(dim, 0).contiguous()
        out = send.new_empty((send.shape[0] // cp, *send.shape[1:]))
        # torch 2.13 renames reduce_scatter_tensor (deprecated there) reduce_scatter_single
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        rs(out, send, group=group)
        return out.movedim(0, dim).contiguous(), None, None


def all_gather_sequence(x: torch.Tensor, group, dim: int = 2) -> torch.Tensor:
    """Every cp rank's part of `x` (along `dim`, load-balanced layout) gathered into the
    whole sequence in order; differentiable (backward reduce-scatters the gradient)."""
    return _AllGatherSequence.apply(x, group, dim)


def repeat_kv(x_BGLD: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, G, L, D] -> [B, G * n_rep, L, D]: each key/value head repeated for the n_rep
    query heads it serves (GQA), as Transformers' `repeat_kv` does."""
    if n_rep == 1:
        return x_BGLD
    B, G, L, D = x_BGLD.shape
    return x_BGLD[:, :, None].expand(B, G, n_rep, L, D).reshape(B, G * n_rep, L, D)


def _check_heads(q, k, v) -> int:
    H, G = q.shape[1], k.shape[1]
    if H % G or v.shape[1] != G:
        raise ValueError(
            f"query heads {H} must be a multiple of key/value heads {G} (and values must "
            f"have {G} heads too, got {v.shape[1]})"
        )
    return H // G


def context_parallel_attention(
    q_BHSD: torch.Tensor,
    k_BGSD: torch.Tensor,
    v_BGSD: torch.Tensor,
    group,
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_padding_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this cp rank's queries against every rank's keys and values.

    Inputs are this rank's load-balanced part (chunk r then chunk 2*cp-1-r along the
    sequence, dim 2). G key/value heads may be fewer than H query heads (GQA: each K/V
    head serves H / G query heads). `scale` defaults to 1/sqrt(D) as in SDPA.
    `key_padding_BS`: optional bool [B, S], True where the token may be attended (a 2-D
    attention mask, sharded like the input ids). Returns [B, H, S, Dv] in the local layout.
    """
    _check_heads(q_BHSD, k_BGSD, v_BGSD)
    S = q_BHSD.shape[2]
    if S % 2:
        raise ValueError(
            f"the local sequence length {S} must be even (a head and a tail chunk): split "
            "the batch with dropless.parallel.context.shard_batch"
        )
    cp, rank = _world(group)
    k_BGLD = all_gather_sequence(k_BGSD, group, 2)
    v_BGLD = all_gather_sequence(v_BGSD, group, 2)
    mask_BL = None
    if key_padding_BS is not None:
        parts = [torch.empty_like(key_padding_BS) for _ in range(cp)]
        dist.all_gather(parts, key_padding_BS.contiguous(), group=group)
        mask_BL = unshard_sequence(parts, 1)
    chunks = (rank, 2 * cp - 1 - rank)
    return attend_gathered(q_BHSD, k_BGLD, v_BGLD, chunks, scale, dropout_p, mask_BL)


def attend_gathered(
    q_BHSD: torch.Tensor,
    k_BGLD: torch.Tensor,
    v_BGLD: torch.Tensor,
    chunks: tuple[int, int],
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_padding_BL: torch.Tensor | None = None,
) -> torch.Tensor:
    """The local part of `context_parallel_attention`, after the gathers: the queries of
    chunks `chunks` (S / 2 tokens each, in that order) against the whole sequence's keys
    and values (and padding mask [B, L]), under the causal mask of their global
    positions. Returns [B, H, S, Dv]."""
    if q_BHSD.device.type == "cpu" and key_padding_BL is None and dropout_p == 0:
        return chunked_causal_attention(q_BHSD, k_BGLD, v_BGLD, chunks, scale)
    C = q_BHSD.shape[2] // 2
    outs = []
    for part, chunk in enumerate(chunks):
        q = q_BHSD[:, :, part * C : (part + 1) * C]
        n_keys = (chunk + 1) * C  # the causal horizon of this chunk's last query
        k, v = k_BGLD[:, :, :n_keys], v_BGLD[:, :, :n_keys]
        outs.append(_causal_sdpa(q, k, v, scale, dropout_p, key_padding_BL, n_keys))
    return torch.cat(outs, 2)


def _causal_sdpa(q, k, v, scale, dropout_p, mask_BL, n_keys):
    """Bottom-right-aligned causal SDPA: query i of Lq sees keys [0, n_keys - Lq + i].

    K/V keep their own (fewer) heads: SDPA's `enable_gqa`, so the gathered K/V are not
    repeated to the query heads. CUDA without a padding mask: `causal_lower_right`, which
    SDPA's flash kernel takes without a mask tensor (unverified: not run). Otherwise (a
    padding mask `mask_BL`, or dropout on CPU) an explicit boolean [Lq, n_keys] mask."""
    Lq = q.shape[2]
    if mask_BL is None and q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        allowed = causal_lower_right(Lq, n_keys)
    else:
        allowed = torch.ones(Lq, n_keys, dtype=torch.bool, device=q.device).tril(n_keys - Lq)
    if mask_BL is not None:
        allowed = allowed[None, None] & mask_BL[:, None, None, :n_keys].to(torch.bool)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale, enable_gqa=True
    )


def reference_attention(
    q_BHLD: torch.Tensor,
    k_BGLD: torch.Tensor,
    v_BGLD: torch.Tensor,
    scale: float | None = None,
    key_padding_BL: torch.Tensor | None = None,
) -> torch.Tensor:
    """The specification: causal SDPA over the whole sequence on one process (GQA by
    repeating K/V heads). Returns [B, H, L, Dv]."""
    n_rep = _check_heads(q_BHLD, k_BGLD, v_BGLD)
    k, v = repeat_kv(k_BGLD, n_rep), repeat_kv(v_BGLD, n_rep)
    if key_padding_BL is None:
        return F.scaled_dot_product_attention(q_BHLD, k, v, is_causal=True, scale=scale)
    L = q_BHLD.shape[2]
    causal = torch.ones(L, L, dtype=torch.bool, device=q_BHLD.device).tril()
    allowed = causal[None, None] & key_padding_BL[:, None, None, :].to(torch.bool)
    return F.scaled_dot_product_attention(q_BHLD, k, v, attn_mask=allowed, scale=scale)
