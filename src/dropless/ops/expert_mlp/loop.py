"""The engine's "loop" schedule (the CPU default): one pass per expert (gather its rows,
gate/up GEMM, activation x prob, down GEMM, `index_add_` into the output in expert
order), on worker threads (`threads.py`) when the experts are many and big enough.
Backward writes the weight gradients straight into [E, ...] tensors and frees each
expert's h (its own tensor) once read. Token sums of 16-bit inputs run in fp32.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted (kept) pairs,
# n rows of one expert, N = 2F (gated) or F

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch

from ..activation.eager import act_forward, act_input_grad, act_parts
from ..lora import lowrank_bwd, lowrank_fwd
from .threads import run_experts

# Below this many forward FLOPs per expert (on average), handing experts to worker
# threads costs more than it saves (a hand-off is tens of microseconds).
MIN_THREADED_FLOPS = 2**21
# Worker threads run single-threaded GEMMs, so they need enough experts to keep every
# thread busy to the end: with fewer than this many per thread (e.g. 8 experts on a
# 16-thread machine) the loop runs in the calling thread with multi-threaded ops.
MIN_EXPERTS_PER_THREAD = 4


def _num_workers(x: torch.Tensor, counts, flops_per_row: int) -> int:
    if x.device.type != "cpu":
        return 1
    busy, threads = sum(1 for n in counts if n), torch.get_num_threads()
    few = busy < MIN_EXPERTS_PER_THREAD * threads
    return 1 if few or sum(counts) * flops_per_row < MIN_THREADED_FLOPS * busy else threads


def _at(g_E, e):
    return None if g_E is None else g_E[e]


def wt(w, e, trans_w):
    """The [in, out] operand of expert e: w[e]^T for the nn.Linear layout, else w[e]."""
    return w[e].t() if trans_w else w[e]


def bounds(counts):
    """(expert, first row, end row) of every expert with rows."""
    lo = 0
    for e, n in enumerate(counts):
        if n:
            yield e, lo, lo + n
        lo += n


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype token sums are accumulated in: fp32 for 16-bit inputs."""
    return torch.promote_types(dtype, torch.float32)


def _row_buffers(x: torch.Tensor, nmax: int, D: int):
    """A factory of (rows in x's dtype, the same rows in the accumulation dtype: the one
    tensor unless x is 16-bit)."""
    acc = _acc_dtype(x.dtype)

    def new():
        rows = x.new_empty(nmax, D)
        return rows, rows if acc == x.dtype else x.new_empty(nmax, D, dtype=acc)

    return new


def _to_acc(bufs, n: int) -> None:
    if bufs[1] is not bufs[0]:
        bufs[1][:n].copy_(bufs[0][:n])


def _run(st, expert, flops_per_row: int, scratch, total) -> None:
    """expert(st, item, scratch, bufs) for every expert of `st`, on worker threads
    (`threads.run_experts`) or here, each one's rows summed into `total` at its tokens in
    expert order (None: written in place). Autocast is off: the loop writes into buffers
    of its inputs' dtype (`out=` ops, which autocast leaves alone), so its few
    autocast-eligible GEMMs must not switch dtype under it."""
    x, counts = st.x, st.counts
    items, new_out = list(bounds(counts)), _row_buffers(x, max(counts, default=0), x.shape[1])

    def commit(item, bufs):
        _, lo, hi = item
        total.index_add_(0, st.token_S[lo:hi], bufs[1][: hi - lo])

    commit = None if total is None else commit
    with torch.autocast("cpu", enabled=False):
        workers = _num_workers(x, counts, flops_per_row)
        kw = dict(make_scratch=scratch, commit=commit, new_out=new_out, workers=workers)
        if workers > 1 and run_experts(items, partial(expert, st), **kw):
            return
        s, bufs = scratch(), None if commit is None else new_out()
        for item in items:
            expert(st, item, s, bufs)
            if commit is not None:
                commit(item, bufs)


def _dims(sv) -> tuple[int, int, int, int]:
    """(D, N = 2F gated or F, F, the most rows of one expert)."""
    N = sv.gate_up.shape[1] if sv.trans_w else sv.gate_up.shape[2]
    return sv.x.shape[1], N, N // 2 if sv.act.gated else N, max(sv.counts, default=0)


def _empty_grad(w: torch.Tensor, counts) -> torch.Tensor:
    g = torch.empty_like(w, memory_format=torch.contiguous_format)
    for e, n in enumerate(counts):
        if not n:
            g[e].zero_()
    return g


def forward(sv, num_out, lr1=None, lr2=None, one_h: bool = False) -> tuple:
    """(out_TD with sv.token_S, else y_SD; sv with h, u1, u2 filled in). h: one tensor
    per expert, or with one_h rows of one [S, N] tensor (the custom op's output)."""
    x, counts = sv.x, sv.counts
    S, (D, N, F, nmax), gathered = int(sum(counts)), _dims(sv), sv.token_S is not None
    sv.u1 = x.new_empty(S, lr1.rank) if lr1 is not None else None
    sv.u2 = x.new_empty(S, lr2.rank) if lr2 is not None else None
    out = x.new_zeros(num_out, D, dtype=_acc_dtype(x.dtype)) if gathered else x.new_empty(S, D)
    h_SN = x.new_empty(S, N) if one_h else None
    st = SimpleNamespace(**vars(sv), lr1=lr1, lr2=lr2, gathered=gathered, h_of={}, h_SN=h_SN)
    st.out = out

    def scratch():
        return {"x": x.new_empty(nmax, D) if gathered else None, "a": x.new_empty(nmax, F)}

    _run(st, _forward_expert, 2 * D * (N + F), scratch, out if gathered else None)
    # one h per expert, empty ones too: the number of saved tensors does not depend on
    # the routing (activation checkpointing compares it with the recompute's)
    empty = x.new_empty(0, N)
    sv.h = h_SN if one_h else tuple(st.h_of.get(e, empty) for e in range(len(counts)))
    return out.to(x.dtype), sv


def backward(sv, g_out, need, release: bool, lr1=None, lr2=None) -> tuple:
    """The grads of `engine.backward`; release: free each expert's h once read."""
    x, counts = sv.x, sv.counts
    hs = sv.h if isinstance(sv.h, tuple) else sv.h.split(counts)
    (D, N, F, nmax), gathered = _dims(sv), sv.token_S is not None
    grads = _grad_buffers(need, gathered, sv)
    st = SimpleNamespace(**vars(sv), hs=hs, lr1=lr1, lr2=lr2, g_out=g_out.contiguous(), **grads)
    st.gathered, st.release = gathered, release and isinstance(sv.h, tuple)

    def scratch():
        # "rows": the gathered gy, then (once gy is used up) the gathered x; act[0] is
        # free once act_parts returns: ap, then the prob gradient's product
        new = partial(x.new_empty, nmax)
        rows = (new(D) if gathered else None, new(F), new(N))
        return dict(zip(("rows", "da", "dh"), rows), act=[new(F) for _ in range(4)])

    _run(st, _backward_expert, 4 * D * (N + F), scratch, st.gx if gathered else None)
    gx = None if st.gx is None else st.gx.to(x.dtype)
    return (gx, st.gp, st.ggu, st.gd, st.ggb, st.gdb, st.g1a, st.g1b, st.g2a, st.g2b)


def _forward_expert(st, item, s, bufs) -> None:
    """One expert's forward, into its rows of the output (or `bufs`)."""
    e, lo, hi = item
    n = hi - lo
    x, lr1, lr2, trans_w = st.x, st.lr1, st.lr2, st.trans_w
    xe = torch.index_select(x, 0, st.token_S[lo:hi], out=s["x"][:n]) if st.gathered else x[lo:hi]
    h_out = None if st.h_SN is None else st.h_SN[lo:hi]
    he = st.h_of[e] = torch.mm(xe, wt(st.gate_up, e, trans_w), out=h_out)
    if lr1 is not None:
        lowrank_fwd(xe, lr1.a_ERI[e], lr1.b_EOR[e], lr1.scale, he, st.u1[lo:hi])
    if st.gu_bias is not None:
        he.add_(st.gu_bias[e])
    p = None if st.prob_S is None else st.prob_S[lo:hi]
    a = act_forward(he, p, st.act, out=s["a"][:n])
    y_out = bufs[0][:n] if st.gathered else st.out[lo:hi]
    ye = torch.mm(a, wt(st.down, e, trans_w), out=y_out)
    if lr2 is not None:
        lowrank_fwd(a, lr2.a_ERI[e], lr2.b_EOR[e], lr2.scale, ye, st.u2[lo:hi])
    if st.d_bias is not None:
        ye.add_(st.d_bias[e]) if p is None else ye.addr_(p, st.d_bias[e])
    if st.gathered:
        _to_acc(bufs, n)


def _grad_buffers(need, gathered, sv) -> dict:
    # every expert's slice of a weight gradient is written by an mm(out=): only experts
    # without tokens need zeros (zero-filling the whole [E, ...] costs ~10%)
    x, prob_S, counts, gu_bias, d_bias = sv.x, sv.prob_S, sv.counts, sv.gu_bias, sv.d_bias
    gate_up, down = sv.gate_up, sv.down
    a1, b1, a2, b2 = sv.lora or (None,) * 4
    gx = None
    if need.x:  # x_TD: a sum over the token's experts, in fp32 for 16-bit; x_SD: one row each
        gx = x.new_zeros(x.shape, dtype=_acc_dtype(x.dtype)) if gathered else torch.empty_like(x)
    return dict(
        gx=gx,
        gp=prob_S.new_zeros(prob_S.shape) if prob_S is not None and need.prob else None,
        ggu=_empty_grad(gate_up, counts) if need.gate_up else None,
        gd=_empty_grad(down, counts) if need.down else None,
        ggb=torch.zeros_like(gu_bias) if gu_bias is not None and need.gate_up_bias else None,
        gdb=torch.zeros_like(d_bias) if d_bias is not None and need.down_bias else None,
        g1a=_empty_grad(a1, counts) if a1 is not None and need.a1 else None,
        g1b=_empty_grad(b1, counts) if b1 is not None and need.b1 else None,
        g2a=_empty_grad(a2, counts) if a2 is not None and need.a2 else None,
        g2b=_empty_grad(b2, counts) if b2 is not None and need.b2 else None,
    )


def _down_backward(st, e, lo, hi, gy, p, a0, act_bufs, da_buf):
    """The down projection's weight, bias and update gradients; returns da (before the
    prob scaling)."""
    trans_w, lr2, gd = st.trans_w, st.lr2, st.gd
    if gd is not None or st.g2a is not None:
        ap = a0 if p is None else torch.mul(a0, p.unsqueeze(1), out=act_bufs[0])
    if gd is not None:
        # y = ap @ W^T: dW = gy^T ap ([D, F]); y = ap @ W: dW = ap^T gy ([F, D])
        torch.mm(gy.t(), ap, out=gd[e]) if trans_w else torch.mm(ap.t(), gy, out=gd[e])
    if st.gdb is not None:
        torch.mv(gy.t(), p, out=st.gdb[e]) if p is not None else torch.sum(gy, 0, out=st.gdb[e])
    da = torch.mm(gy, wt(st.down, e, trans_w).t(), out=da_buf)
    if lr2 is not None:
        xa = ap if st.g2a is not None else None
        gu = lowrank_bwd(
            gy, xa, st.u2[lo:hi], lr2.b_EOR[e], lr2.scale, _at(st.g2a, e), _at(st.g2b, e)
        )
        da.addmm_(gu, lr2.a_ERI[e])
    return da


def _gate_up_backward(st, e, lo, hi, dh, s, dx_out):
    """The gate/up projection's weight and update gradients, and dx."""
    n, trans_w, lr1 = hi - lo, st.trans_w, st.lr1
    if st.ggu is not None or st.g1a is not None:
        x = st.x
        xe = (
            torch.index_select(x, 0, st.token_S[lo:hi], out=s["rows"][:n])
            if st.gathered
            else x[lo:hi]
        )
    if st.ggu is not None:
        torch.mm(dh.t(), xe, out=st.ggu[e]) if trans_w else torch.mm(xe.t(), dh, out=st.ggu[e])
    if lr1 is not None:
        xa = xe if st.g1a is not None else None
        gu = lowrank_bwd(
            dh, xa, st.u1[lo:hi], lr1.b_EOR[e], lr1.scale, _at(st.g1a, e), _at(st.g1b, e)
        )
    if st.gx is not None:
        w_in = wt(st.gate_up, e, trans_w).t()  # [2F, D]
        dx = torch.mm(dh, w_in, out=dx_out)
        if lr1 is not None:
            dx.addmm_(gu, lr1.a_ERI[e])


def _backward_expert(st, item, s, bufs) -> None:
    """One expert's backward, its activation recomputed from the kept h."""
    e, lo, hi = item
    n = hi - lo
    gy = st.g_out[lo:hi]
    if st.gathered:
        gy = torch.index_select(st.g_out, 0, st.token_S[lo:hi], out=s["rows"][:n])
    p = None if st.prob_S is None else st.prob_S[lo:hi]
    act_bufs = [b[:n] for b in s["act"]]
    a0, d_gate, d_up = act_parts(st.hs[e], st.act, act_bufs)
    if st.release:
        st.hs[e].untyped_storage().resize_(0)  # h is this call's own
    da = _down_backward(st, e, lo, hi, gy, p, a0, act_bufs, s["da"][:n])
    if st.gp is not None:
        gpe = st.gp[lo:hi]
        torch.sum(torch.mul(da, a0, out=act_bufs[0]), 1, out=gpe)
        if st.d_bias is not None:
            gpe.add_(torch.mv(gy, st.d_bias[e]))
    if p is not None:
        da.mul_(p.unsqueeze(1))
    dh = act_input_grad(da, d_gate, d_up, st.act.interleaved, s["dh"][:n])
    if st.ggb is not None:
        torch.sum(dh, 0, out=st.ggb[e])
    dx_out = None
    if st.gx is not None:
        dx_out = bufs[0][:n] if st.gathered else st.gx[lo:hi]
    _gate_up_backward(st, e, lo, hi, dh, s, dx_out)
    if st.gathered and st.gx is not None:
        _to_acc(bufs, n)
