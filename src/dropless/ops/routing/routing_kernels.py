"""Routing kernels: top-k routing (forward and backward) and the routing metadata sort.

Algorithm, routing (`route`). One program owns BLOCK_T tokens and all E experts of each
(E padded to a power of two). Forward: scores in fp32 (softmax: max, exp, sum; or
sigmoid); the choice scores add the expert bias; with groups (DeepSeek-V3) a group's
score is the sum of its two best choice scores (the best when a group holds one expert),
the best `topk_group` groups are kept and the others masked; then K rounds of argmax,
each taking the best expert still free and the unbiased score there. Ties go to the
lowest expert (and group) index, so ids_TK lists the chosen experts as a stable
descending sort of the choice scores would. The top-k weights are renormalised (sum + 1e-20)
and scaled. Writes weights_TK, ids_TK (int64) and, when asked, scores_TE.

Backward saves nothing but the logits (the input) and ids_TK: it recomputes the scores
of each token from its logits, the raw top-k scores at the saved ids, the gradient of
the renormalisation and scaling, adds the dense gradient of scores_TE (the load-balancing
loss reads it), and applies the softmax or sigmoid derivative. No atomics.

Algorithm, metadata (`sort_pairs`): a stable counting sort of the T*K flat pairs over B
buckets (experts, plus one for pairs dropped by a capacity limit). (1) each program
counts its BLOCK_P pairs per bucket; (2) one program scans the [blocks, B] counts in
expert-major order: each bucket's total (counts_E), its cumulative end (int32, the
offsets every grouped GEMM takes) and each block's first slot in each bucket; (3) each
program places its pairs: slot = block start of the pair's bucket + the number of earlier
pairs of the block in the same bucket. The order equals `torch.argsort(ids, stable=True)`:
by expert, then by (token, k), deterministic and without atomics.

Semantics equal `reference.route_reference` (ties aside: torch.topk leaves
their order unspecified) and `dropless.ops.sort_by_expert`.
"""

# T tokens, E experts, K top-k, G expert groups, P = T*K pairs, B buckets, S sorted pairs

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..permute.eager import SortedPairs
from ..specs import RoutingConfig

# larger than any expert index: "no candidate" in the argmin of indices
_BIG = tl.constexpr(1 << 30)


@triton.jit
def _load_scores(logits_ptr, offs_t, offs_e, mask_t, mask_e, stride, SOFTMAX: tl.constexpr):
    """fp32 scores [BLOCK_T, BLOCK_E] (0 in padded columns), the softmax of the logits
    (the scores when SOFTMAX) and their logsumexp (for the z-loss)."""
    mask = mask_t[:, None] & mask_e[None, :]
    x = tl.load(logits_ptr + offs_t[:, None].to(tl.int64) * stride + offs_e[None, :], mask=mask)
    x = tl.where(mask_e[None, :], x.to(tl.float32), float("-inf"))
    x = tl.where(mask_t[:, None], x, 0.0)  # rows past T: finite, never stored
    m = tl.max(x, 1)
    p = tl.exp(x - m[:, None])
    z = tl.sum(p, 1)
    sm = p / z[:, None]
    if SOFTMAX:
        s = sm
    else:
        s = tl.where(mask_e[None, :], tl.sigmoid(x), 0.0)
    return s, sm, m + tl.log(z)


@triton.jit
def _first_max(v, avail, offs):
    """Per row: the largest value of v where avail, and its lowest index (ties)."""
    v = tl.where(avail, v, float("-inf"))
    m = tl.max(v, 1)
    idx = tl.min(tl.where(avail & (v == m[:, None]), offs[None, :], _BIG), 1)
    return m, idx


@triton.jit
def _group_mask(choice, valid, offs_e, G, PER: tl.constexpr, TOPK_GROUP, BLOCK_G: tl.constexpr):
    """Which experts sit in the best TOPK_GROUP groups of each row (DeepSeek-V3)."""
    offs_g = tl.arange(0, BLOCK_G)
    gid = offs_e // PER
    gscore = tl.zeros((choice.shape[0], BLOCK_G), dtype=tl.float32)
    for g in range(G):
        ing = valid & (gid == g)[None, :]
        m1, i1 = _first_max(choice, ing, offs_e)
        gs = m1
        if PER > 1:
            m2, i2 = _first_max(choice, ing & (offs_e[None, :] != i1[:, None]), offs_e)
            gs = m1 + m2
        gscore = tl.where(offs_g[None, :] == g, gs[:, None], gscore)
    gavail = (offs_g < G)[None, :] & (gscore == gscore)
    keep = valid & (gid < 0)[None, :]
    for _j in range(TOPK_GROUP):
        mg, ig = _first_max(gscore, gavail, offs_g)
        gavail = gavail & (offs_g[None, :] != ig[:, None])
        keep = keep | (gid[None, :] == ig[:, None])
    return keep & valid


@triton.jit
def route_fwd_kernel(
    logits_ptr, bias_ptr, given_ptr, w_ptr, ids_ptr, scores_ptr, psum_ptr, zsum_ptr, T, E,
    stride_l, K, scale, G, TOPK_GROUP, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr, PER: tl.constexpr, RENORM: tl.constexpr, WRITE_SCORES: tl.constexpr,
    STATS: tl.constexpr, GIVEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    mask_t, mask_e = offs_t < T, offs_e < E
    s, sm, lse = _load_scores(logits_ptr, offs_t, offs_e, mask_t, mask_e, stride_l, SOFTMAX)
    if STATS:  # this block's share of the load-balancing and z losses
        pn = s / tl.maximum(tl.sum(s, 1), 1e-20)[:, None]
        pn = tl.where(mask_t[:, None], pn, 0.0)
        tl.store(psum_ptr + tl.program_id(0) * E + offs_e, tl.sum(pn, 0), mask=mask_e)
        tl.store(zsum_ptr + tl.program_id(0), tl.sum(tl.where(mask_t, lse * lse, 0.0), 0))
    if WRITE_SCORES:
        dst = scores_ptr + offs_t[:, None].to(tl.int64) * E + offs_e[None, :]
        tl.store(dst, s, mask=mask_t[:, None] & mask_e[None, :])
    choice = s
    if HAS_BIAS:
        choice = s + tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)[None, :]
    avail = mask_e[None, :] & (offs_t >= 0)[:, None]
    if GROUPED:
        avail = _group_mask(choice, avail, offs_e, G, PER, TOPK_GROUP, BLOCK_G)
    out = offs_t[:, None].to(tl.int64) * K + offs_k[None, :]
    mask_tk = mask_t[:, None] & (offs_k < K)[None, :]
    w_tk = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    id_tk = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    if GIVEN:  # the recompute of a checkpointed forward: its choice, today's scores
        id_tk = tl.load(given_ptr + out, mask=mask_tk, other=0).to(tl.int32)
    for k in range(K):
        if GIVEN:
            idx = tl.sum(tl.where(offs_k[None, :] == k, id_tk, 0), 1)
        else:
            best, idx = _first_max(choice, avail, offs_e)
        sel = offs_e[None, :] == idx[:, None]
        w = tl.sum(tl.where(sel, s, 0.0), 1)
        avail = avail & ~sel
        w_tk = tl.where(offs_k[None, :] == k, w[:, None], w_tk)
        id_tk = tl.where(offs_k[None, :] == k, idx[:, None], id_tk)
    if RENORM:
        w_tk = w_tk / (tl.sum(w_tk, 1)[:, None] + 1e-20)
    w_tk = w_tk * scale
    tl.store(w_ptr + out, w_tk, mask=mask_tk)
    tl.store(ids_ptr + out, id_tk.to(tl.int64), mask=mask_tk)


@triton.jit
def route_bwd_kernel(
    logits_ptr, ids_ptr, gw_ptr, gs_ptr, gp_ptr, gz_ptr, dl_ptr, T, E, stride_l, K, scale,
    SOFTMAX: tl.constexpr, HAS_GW: tl.constexpr, HAS_GS: tl.constexpr, HAS_GP: tl.constexpr,
    HAS_GZ: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    mask_t, mask_e = offs_t < T, offs_e < E
    mask_te = mask_t[:, None] & mask_e[None, :]
    row_te = offs_t[:, None].to(tl.int64) * E + offs_e[None, :]
    s, sm, lse = _load_scores(logits_ptr, offs_t, offs_e, mask_t, mask_e, stride_l, SOFTMAX)
    grad = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    if HAS_GS:
        grad = tl.load(gs_ptr + row_te, mask=mask_te, other=0.0).to(tl.float32)
    if HAS_GP:
        # probs_sum[e] = sum_t s[t,e] / max(sum_e s[t,e], 1e-20); the clamp passes no gradient
        gp = tl.load(gp_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)[None, :]
        tot = tl.sum(s, 1)
        zc = tl.maximum(tot, 1e-20)
        dpn = gp - tl.where(tot >= 1e-20, tl.sum(gp * s, 1) / zc, 0.0)[:, None]
        grad += dpn / zc[:, None]
    if HAS_GW:
        mask_tk = mask_t[:, None] & (offs_k < K)[None, :]
        row_tk = offs_t[:, None].to(tl.int64) * K + offs_k[None, :]
        ids = tl.load(ids_ptr + row_tk, mask=mask_tk, other=-1).to(tl.int32)
        gw = tl.load(gw_ptr + row_tk, mask=mask_tk, other=0.0).to(tl.float32)
        raw = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for k in range(K):
            id_k = tl.sum(tl.where(offs_k[None, :] == k, ids, 0), 1)
            r = tl.sum(tl.where(offs_e[None, :] == id_k[:, None], s, 0.0), 1)
            raw = tl.where(offs_k[None, :] == k, r[:, None], raw)
        if RENORM:
            # w = scale * raw / (sum raw + eps): d/draw_j = scale / D * (g_j - <g, raw> / D)
            d = tl.sum(raw, 1) + 1e-20
            draw = (scale / d)[:, None] * (gw - (tl.sum(gw * raw, 1) / d)[:, None])
        else:
            draw = gw * scale
        for k in range(K):
            id_k = tl.sum(tl.where(offs_k[None, :] == k, ids, 0), 1)
            g_k = tl.sum(tl.where(offs_k[None, :] == k, draw, 0.0), 1)
            grad += tl.where(offs_e[None, :] == id_k[:, None], g_k[:, None], 0.0)
    if SOFTMAX:
        dl = s * (grad - tl.sum(grad * s, 1)[:, None])
    else:
        dl = grad * s * (1.0 - s)
    if HAS_GZ:  # zsq_sum = sum_t lse_t^2: d/dx = 2 lse softmax(x)
        dl += (2.0 * tl.load(gz_ptr).to(tl.float32)) * lse[:, None] * sm
    tl.store(dl_ptr + row_te, dl.to(dl_ptr.dtype.element_ty), mask=mask_te)


def _route_blocks(logits_TE: torch.Tensor) -> tuple[int, int, int]:
    """(tokens per program, padded E, num_warps)."""
    E = logits_TE.shape[1]
    block_e = triton.next_power_of_2(max(E, 1))
    if not logits_TE.is_cuda:
        return 4, block_e, 1  # interpreter: tiny shapes still span several programs
    block_t = max(1, min(64, 4096 // block_e))
    return block_t, block_e, 4 if block_t * block_e >= 2048 else 2


def route_fwd(
    logits_TE: torch.Tensor,
    top_k: int,
    routing: RoutingConfig,
    expert_bias_E: torch.Tensor | None = None,
    *,
    write_scores: bool = True,
    stats: bool = False,
    ids_TK: torch.Tensor | None = None,
):
    """(weights_TK fp32, ids_TK int64, scores_TE fp32 or None, probs_sum_E, zsq_sum), no
    autograd. With stats: probs_sum_E [E] = sum over tokens of the scores normalised per
    token, zsq_sum = sum over tokens of logsumexp(logits)^2 (fp32; else both None).
    ids_TK given: no selection, the weights of these experts (a replayed choice)."""
    T, E = logits_TE.shape
    logits_TE = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
    dev = logits_TE.device
    w = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=dev)
    scores = torch.empty(T, E, dtype=torch.float32, device=dev) if write_scores else None
    bt, be, warps = _route_blocks(logits_TE)
    nb = triton.cdiv(T, bt)
    # per-program partial sums (each program writes its row), added in program order
    # below: deterministic
    psum = torch.empty(nb if stats and T else 0, E, dtype=torch.float32, device=dev)
    zsum = torch.empty(nb if stats and T else 0, dtype=torch.float32, device=dev)
    if T:
        given = ids_TK is not None
        grouped = routing.n_group is not None and routing.n_group > 1 and not given
        G = routing.n_group if grouped else 1
        has_bias = expert_bias_E is not None and not given
        bias = expert_bias_E.contiguous() if has_bias else w
        route_fwd_kernel[(nb,)](
            logits_TE, bias, ids_TK.contiguous() if given else ids, w, ids,
            scores if write_scores else w, psum if stats else w,
            zsum if stats else w, T, E, logits_TE.stride(0), top_k,
            float(routing.scaling_factor), G, routing.topk_group if grouped else 1,
            SOFTMAX=routing.score_func == "softmax", HAS_BIAS=has_bias,
            GROUPED=grouped, PER=E // G, RENORM=routing.renormalize, WRITE_SCORES=write_scores,
            STATS=stats, GIVEN=given, BLOCK_T=bt, BLOCK_E=be, BLOCK_K=triton.next_power_of_2(top_k),
            BLOCK_G=triton.next_power_of_2(G), num_warps=warps,
        )  # fmt: skip
    if not stats:
        return w, ids, scores, None, None
    return w, ids, scores, psum.sum(0), zsum.sum()


def route_bwd(
    logits_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    grad_w_TK: torch.Tensor | None,
    grad_scores_TE: torch.Tensor | None,
    routing: RoutingConfig,
    grad_probs_sum_E: torch.Tensor | None = None,
    grad_zsq_sum: torch.Tensor | None = None,
) -> torch.Tensor:
    """d loss / d logits_TE (logits' dtype) from the gradients of route_fwd's outputs
    (None: no gradient). The scalar gradient is read on the device: no host sync."""
    T, E = logits_TE.shape
    K = ids_TK.shape[1]
    logits_TE = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
    dl = torch.empty_like(logits_TE, memory_format=torch.contiguous_format)
    if T == 0:
        return dl
    bt, be, warps = _route_blocks(logits_TE)

    def arg(t):
        return t.contiguous() if t is not None else dl

    route_bwd_kernel[(triton.cdiv(T, bt),)](
        logits_TE, ids_TK.contiguous(), arg(grad_w_TK), arg(grad_scores_TE),
        arg(grad_probs_sum_E), arg(grad_zsq_sum), dl, T, E, logits_TE.stride(0), K,
        float(routing.scaling_factor), SOFTMAX=routing.score_func == "softmax",
        HAS_GW=grad_w_TK is not None, HAS_GS=grad_scores_TE is not None,
        HAS_GP=grad_probs_sum_E is not None, HAS_GZ=grad_zsq_sum is not None,
        RENORM=routing.renormalize, BLOCK_T=bt, BLOCK_E=be,
        BLOCK_K=triton.next_power_of_2(K), num_warps=warps,
    )  # fmt: skip
    return dl


class _Route(torch.autograd.Function):
    """Routing (and, with stats, the loss sums) with a backward that saves only the
    logits (the input) and ids_TK."""

    @staticmethod
    def forward(ctx, logits_TE, expert_bias_E, top_k, routing, stats, ids_TK):
        out = route_fwd(logits_TE, top_k, routing, expert_bias_E, stats=stats, ids_TK=ids_TK)
        ctx.save_for_backward(logits_TE, out[1])
        ctx.routing = routing
        ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    def backward(ctx, grad_w, _grad_ids, grad_scores, grad_psum, grad_zsum):
        logits_TE, ids = ctx.saved_tensors
        dl = route_bwd(logits_TE, ids, grad_w, grad_scores, ctx.routing, grad_psum, grad_zsum)
        return dl, None, None, None, None, None


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    routing: RoutingConfig,
    expert_bias_E: torch.Tensor | None = None,
    *,
    ids_TK: torch.Tensor | None = None,
):
    """(weights_TK fp32, ids_TK int64, scores_TE fp32), as `dropless.ops.route`, with
    autograd to the logits (the bias only selects: it gets no gradient). ids_TK given:
    these experts instead of a selection (the recompute of a checkpointed forward).
    Arguments are checked by `dropless.ops.route`, which calls this on CUDA."""
    return _Route.apply(logits_TE, expert_bias_E, top_k, routing, False, ids_TK)[:3]


def route_with_aux(
    logits_TE: torch.Tensor,
    top_k: int,
    routing: RoutingConfig,
    expert_bias_E: torch.Tensor | None = None,
    *,
    ids_TK: torch.Tensor | None = None,
):
    """As `dropless.ops.route_with_aux`: route's outputs plus probs_mean_E (the mean over
    tokens of the per-token normalised scores, what the load-balancing loss reads) and
    the router z-loss, from the same pass over the scores, forward and backward."""
    w, ids, scores, psum, zsum = _Route.apply(
        logits_TE, expert_bias_E, top_k, routing, True, ids_TK
    )
    T = logits_TE.shape[0]  # T = 0: NaN means, as torch's
    return w, ids, scores, psum / T, zsum / T


# --- routing metadata: the stable counting sort ------------------------------------


@triton.jit
def hist_kernel(ids_ptr, cnt_ptr, P, B, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1).to(tl.int32)
    for b0 in range(0, B, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        cnt = tl.sum((ids[:, None] == offs_b[None, :]).to(tl.int32), 0)
        tl.store(cnt_ptr + tl.program_id(0) * B + offs_b, cnt, mask=offs_b < B)


@triton.jit
def scan_kernel(
    cnt_ptr, start_ptr, counts_ptr, ends_ptr, NB, B,
    BLOCK_NB: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    carry = tl.sum(tl.zeros((BLOCK_B,), dtype=tl.int32), 0)
    for b0 in range(0, B, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask_b = offs_b < B
        tot = tl.zeros((BLOCK_B,), dtype=tl.int32)
        for n0 in range(0, NB, BLOCK_NB):
            offs_n = n0 + tl.arange(0, BLOCK_NB)
            m = (offs_n < NB)[:, None] & mask_b[None, :]
            tile = tl.load(cnt_ptr + offs_n[:, None] * B + offs_b[None, :], mask=m, other=0)
            tot += tl.sum(tile, 0)
        run = carry + tl.cumsum(tot, 0) - tot  # each bucket's first slot
        tl.store(counts_ptr + offs_b, tot.to(tl.int64), mask=mask_b)
        tl.store(ends_ptr + offs_b, run + tot, mask=mask_b)
        carry += tl.sum(tot, 0)
        for n0 in range(0, NB, BLOCK_NB):
            offs_n = n0 + tl.arange(0, BLOCK_NB)
            m = (offs_n < NB)[:, None] & mask_b[None, :]
            at = offs_n[:, None] * B + offs_b[None, :]
            tile = tl.load(cnt_ptr + at, mask=m, other=0)
            tl.store(start_ptr + at, run[None, :] + tl.cumsum(tile, 0) - tile, mask=m)
            run += tl.sum(tile, 0)


@triton.jit
def place_kernel(ids_ptr, start_ptr, pair_ptr, token_ptr, slot_ptr, P, B, K, BLOCK_P: tl.constexpr):
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    ids = tl.load(ids_ptr + offs_p, mask=mask_p, other=-1).to(tl.int32)
    # earlier pairs of this block in the same bucket: the stable rank
    lane = tl.arange(0, BLOCK_P)
    same = (ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(same.to(tl.int32), 1)
    base = tl.load(start_ptr + tl.program_id(0) * B + ids, mask=mask_p, other=0)
    slot = base + rank
    tl.store(slot_ptr + offs_p, slot, mask=mask_p)
    tl.store(pair_ptr + slot, offs_p, mask=mask_p)
    tl.store(token_ptr + slot, offs_p // K, mask=mask_p)


def _sort_blocks(t: torch.Tensor) -> tuple[int, int, int]:
    """(pairs per program, buckets per chunk, pairs-block rows per scan chunk)."""
    return (128, 128, 64) if t.is_cuda else (16, 8, 4)


def sort_pairs(flat_P: torch.Tensor, num_buckets: int, K: int = 1):
    """Stable counting sort of integer bucket ids flat_P [P] in [0, num_buckets).

    Returns (pair_S, token_S, slot_P, counts_B, ends_B): pair_S [P] int32 the pair in each
    slot (by bucket, then pair index), token_S = pair_S // K, slot_P [P] int32 the slot of
    each pair, counts_B int64, ends_B int32 cumulative ends (bucket b holds slots
    [ends[b] - counts[b], ends[b])). Nothing is read on the host.
    """
    P, dev = flat_P.shape[0], flat_P.device
    bp, bb, bn = _sort_blocks(flat_P)
    nb = max(triton.cdiv(P, bp), 1)
    pair = torch.empty(P, dtype=torch.int32, device=dev)
    token = torch.empty(P, dtype=torch.int32, device=dev)
    slot = torch.empty(P, dtype=torch.int32, device=dev)
    counts = torch.empty(num_buckets, dtype=torch.int64, device=dev)
    ends = torch.empty(num_buckets, dtype=torch.int32, device=dev)
    # every program writes its whole row of counts; with no pair the scan reads zeros
    alloc = torch.empty if P else torch.zeros
    cnt = alloc(nb, num_buckets, dtype=torch.int32, device=dev)
    start = torch.empty_like(cnt)
    flat_P = flat_P.contiguous()
    if P:
        hist_kernel[(nb,)](flat_P, cnt, P, num_buckets, BLOCK_P=bp, BLOCK_B=bb)
    scan_kernel[(1,)](cnt, start, counts, ends, nb, num_buckets, BLOCK_NB=bn, BLOCK_B=bb)
    if P:
        place_kernel[(nb,)](flat_P, start, pair, token, slot, P, num_buckets, K, BLOCK_P=bp)
    return pair, token, slot, counts, ends


def sort_by_expert(
    ids_TK: torch.Tensor,
    num_experts: int,
    keep_TK: torch.Tensor | None = None,
    *,
    host_counts: bool = True,
) -> SortedPairs:
    """`dropless.ops.sort_by_expert` by the counting sort: the same slots and order, with
    int32 token_S / pair_S / slot_TK and `offsets_E` (int32 cumulative ends, computed
    once here for every grouped GEMM of the layer). Arguments are checked there."""
    T, K = ids_TK.shape
    flat = ids_TK.reshape(-1)
    buckets = num_experts
    if keep_TK is not None:
        # dropped pairs go to bucket E, after every kept pair
        flat = torch.where(keep_TK.reshape(-1), flat, torch.full_like(flat, num_experts))
        buckets += 1
    pair, token, slot, counts, ends = sort_pairs(flat, buckets, K)
    counts_E, ends_E = counts[:num_experts], ends[:num_experts]
    if not host_counts:
        return SortedPairs(token, pair, slot.view(T, K), counts_E, None, offsets_E=ends_E)
    host = counts_E.tolist()  # host sync, once per layer
    S = sum(host)
    slot_TK = slot.view(T, K)
    if S < T * K:
        slot_TK = slot_TK.clamp_max(S)  # dropped pairs point one past the last slot
    return SortedPairs(
        token[:S], pair[:S], slot_TK, counts_E, host, num_dropped=T * K - S, offsets_E=ends_E
    )
