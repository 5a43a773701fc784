"""Causal attention of a cp rank's two chunks against the gathered keys, block by block (CPU).

Chunk j of the sequence (length C) attends to the keys before it (no mask) and to its own
chunk (square causal mask): each part is one call of SDPA's CPU flash kernel, which also
returns the rows' log-sum-exp, and the two outputs are merged by their log-sum-exps (as
ring attention does), so nothing of length (j+1) C is built for the queries. Backward runs
the kernel's backward on each part with the merged output and log-sum-exp, which gives
each part's exact share of the gradients. In the unmasked part the query heads that share
a key/value head are folded into its rows (exact: no row's mask depends on its position),
so the gathered keys are not repeated (docs/parallel.md, "Context parallelism";
`attention.reference_attention` is the specification).
"""

# B batch, H query heads, G key/value heads, R = H / G, C chunk length, L global length,
# D head dim (Dq of queries and keys, Dv of values)

from __future__ import annotations

import torch
import torch.nn.functional as F

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _fold(x_BHCD: torch.Tensor, G: int) -> torch.Tensor:
    """[B, H, C, ...] -> [B, G, R C, ...]: the query heads of one key/value head as rows."""
    B, H = x_BHCD.shape[:2]
    return x_BHCD.reshape(B, G, -1, *x_BHCD.shape[3:])


def _unfold(x_BGRC: torch.Tensor, H: int) -> torch.Tensor:
    """The inverse of `_fold`."""
    B = x_BGRC.shape[0]
    return x_BGRC.reshape(B, H, -1, *x_BGRC.shape[3:])


def _repeat(x_BGCD: torch.Tensor, R: int) -> torch.Tensor:
    """[B, G, C, D] -> [B, G R, C, D], key/value head g serving query heads g R .. g R + R - 1."""
    return x_BGCD.repeat_interleave(R, dim=1) if R > 1 else x_BGCD


def _parts(j: int, C: int):
    """Chunk j's two key ranges: (start, end, causal) for the keys before it (absent for
    chunk 0) and for its own keys."""
    return ([(0, j * C, False)] if j else []) + [(j * C, (j + 1) * C, True)]


class _ChunkedCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHSD, k_BGLD, v_BGLD, chunks, scale):
        B, H, S, D = q_BHSD.shape
        G, C = k_BGLD.shape[1], S // 2
        R = H // G
        outs, lses = [], []
        for i, j in enumerate(chunks):
            q = q_BHSD[:, :, i * C : (i + 1) * C]
            out, lse = None, None
            for start, end, causal in _parts(j, C):
                k, v = k_BGLD[:, :, start:end], v_BGLD[:, :, start:end]
                if causal:
                    o, o_lse = _fwd(q, _repeat(k, R), _repeat(v, R), 0.0, True, scale=scale)
                else:
                    o, o_lse = _fwd(_fold(q, G), k, v, 0.0, False, scale=scale)
                    o, o_lse = _unfold(o, H), _unfold(o_lse, H)
                if out is None:
                    out, lse = _wide(o), o_lse
                else:
                    out, lse = _merge(out, lse, o, o_lse)
            outs.append(out.to(q.dtype))
            lses.append(lse)
        out_BHSD, lse_BHS = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q_BHSD, k_BGLD, v_BGLD, out_BHSD, lse_BHS)
        ctx.chunks, ctx.scale = chunks, scale
        return out_BHSD

    @staticmethod
    def backward(ctx, dout_BHSD):
        q_BHSD, k_BGLD, v_BGLD, out_BHSD, lse_BHS = ctx.saved_tensors
        B, H, S, D = q_BHSD.shape
        G, C = k_BGLD.shape[1], S // 2
        R = H // G
        dq_BHSD = torch.zeros_like(q_BHSD)
        dk_BGLD, dv_BGLD = torch.zeros_like(k_BGLD), torch.zeros_like(v_BGLD)
        dout_BHSD = dout_BHSD.contiguous()
        for i, j in enumerate(ctx.chunks):
            rows = slice(i * C, (i + 1) * C)
            q, dout = q_BHSD[:, :, rows], dout_BHSD[:, :, rows]
            out, lse = out_BHSD[:, :, rows], lse_BHS[:, :, rows]
            for start, end, causal in _parts(j, C):
                k, v = k_BGLD[:, :, start:end], v_BGLD[:, :, start:end]
                if causal:
                    dq, dk, dv = _bwd(
                        dout, q, _repeat(k, R), _repeat(v, R), out, lse, 0.0, True,
                        scale=ctx.scale,
                    )  # fmt: skip
                    dk, dv = _sum_heads(dk, G), _sum_heads(dv, G)
                else:
                    dq, dk, dv = _bwd(
                        _fold(dout, G), _fold(q, G), k, v, _fold(out, G), _fold(lse, G), 0.0,
                        False, scale=ctx.scale,
                    )  # fmt: skip
                    dq = _unfold(dq, H)
                dq_BHSD[:, :, rows] += dq
                dk_BGLD[:, :, start:end] += dk
                dv_BGLD[:, :, start:end] += dv
        return dq_BHSD, dk_BGLD, dv_BGLD, None, None


def _merge(out, lse, o, o_lse):
    """Two attention results over disjoint key sets -> the result over their union."""
    new = torch.logaddexp(lse, o_lse)
    out = out * torch.exp(lse - new)[..., None] + _wide(o) * torch.exp(o_lse - new)[..., None]
    return out, new


def _wide(o: torch.Tensor) -> torch.Tensor:
    """A part's output in the merge's dtype: fp32 for bf16/fp16/fp32, fp64 kept as fp64."""
    return o.to(torch.promote_types(o.dtype, torch.float32))


def _sum_heads(x_BHCD: torch.Tensor, G: int) -> torch.Tensor:
    """[B, G R, C, D] -> [B, G, C, D]: the gradient of `_repeat`."""
    B, H, C, D = x_BHCD.shape
    return x_BHCD.view(B, G, H // G, C, D).sum(2) if H > G else x_BHCD


def chunked_causal_attention(
    q_BHSD: torch.Tensor,
    k_BGLD: torch.Tensor,
    v_BGLD: torch.Tensor,
    chunks: tuple[int, int],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of the local queries (chunk `chunks[0]` then `chunks[1]`, each
    S / 2 long) against the whole sequence's keys and values `k_BGLD`, `v_BGLD` (G key/value
    heads, G dividing H); differentiable in all three. Returns [B, H, S, Dv]."""
    Dq, Dv = q_BHSD.shape[-1], v_BGLD.shape[-1]
    scale = Dq**-0.5 if scale is None else scale
    if Dq == Dv:
        return _ChunkedCausalAttention.apply(q_BHSD, k_BGLD, v_BGLD, tuple(chunks), scale)
    # the CPU flash kernel takes one head size (MLA has Dq 192, Dv 128): zero columns change
    # neither the scores nor the kept outputs
    D = max(Dq, Dv)
    q, k, v = (F.pad(t, (0, D - t.shape[-1])) for t in (q_BHSD, k_BGLD, v_BGLD))
    return _ChunkedCausalAttention.apply(q, k, v, tuple(chunks), scale)[..., :Dv]
