"""The per-expert loop behind `fused_mlp` (the CPU default); see fused_mlp.py for the
contract and what is saved for backward.

Each expert is one work item (`expert_threads.run_experts`): gather its rows, gate/up
GEMM, activation x prob, down GEMM, and, for the combine, an `index_add_` into the
output committed in expert order. With more than one torch thread and experts big
enough to pay for a hand-off, the items run on worker threads with single-threaded ops;
otherwise in the calling thread. Backward is the same per expert, writing the weight
gradients straight into preallocated [E, ...] tensors.

Each expert's gate/up output h is its own saved tensor, so that a backward that frees
the graph (no retain_graph, no create_graph) can free it as soon as that expert's
activation gradient is formed: the weight gradients fill up while the kept h drains,
instead of both being whole at the end of the layer's backward (measured on the pinned
e2e model: 20 MiB less peak step memory).
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted (kept) pairs,
# n rows of one expert, N = 2F (gated) or F

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from .activations import act_forward, act_input_grad, act_parts
from .expert_threads import run_experts
from .lora import _at, _lowranks, lowrank_bwd, lowrank_fwd
from .mlp_parts import _bounds, _wt

# Below this many forward FLOPs per expert (on average), handing experts to worker
# threads costs more than it saves (a hand-off is tens of microseconds).
MIN_THREADED_FLOPS = 2**21
# Worker threads run single-threaded GEMMs, so they need enough experts to keep every
# thread busy to the end: with fewer than this many per thread (e.g. 8 experts on a
# 16-thread machine) the loop runs in the calling thread with multi-threaded ops.
MIN_EXPERTS_PER_THREAD = 4


def _modes_active() -> bool:
    """A TorchDispatchMode / TorchFunctionMode (a FLOP counter, a debug mode) is per
    thread: ops on worker threads would escape it, so the loop stays in this thread."""
    return is_in_torch_dispatch_mode() or torch._C._is_torch_function_mode_enabled()


def _num_workers(x: torch.Tensor, counts, flops_per_row: int) -> int:
    if x.device.type != "cpu" or _modes_active():
        return 1
    busy, threads = sum(1 for n in counts if n), torch.get_num_threads()
    if busy < MIN_EXPERTS_PER_THREAD * threads:
        return 1
    if sum(counts) * flops_per_row < MIN_THREADED_FLOPS * busy:
        return 1
    return threads


def _graph_released() -> bool:
    """True inside a backward that frees the graph as it goes (retain_graph and
    create_graph off): only then may a saved tensor be freed before its node ends, as
    autograd would free it right after. False when torch cannot tell (a private call)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep is not None and not keep()


def _free(t: torch.Tensor) -> None:
    """Give a tensor's memory back now; its storage is its own (allocated by the loop)."""
    t.untyped_storage().resize_(0)


def _empty_grad(w: torch.Tensor, counts) -> torch.Tensor:
    g = torch.empty_like(w, memory_format=torch.contiguous_format)
    for e, n in enumerate(counts):
        if not n:
            g[e].zero_()
    return g


class _LoopMLP(torch.autograd.Function):
    """x (x_TD with token_S, or x_SD when token_S is None) -> out_TD (or y_SD)."""

    @staticmethod
    def forward(ctx, x, prob_S, gate_up, down, gu_bias, d_bias, token_S, counts, cfg, *lora):
        act, trans_w, num_out = cfg
        lr1, lr2 = _lowranks(lora)
        S, D = int(sum(counts)), x.shape[1]
        N = gate_up.shape[1] if trans_w else gate_up.shape[2]  # 2F gated, F not
        F = N // 2 if act.gated else N
        nmax = max(counts, default=0)
        gathered = token_S is not None
        h_of = {}  # expert -> its [n, N] gate/up output, kept for backward
        out = x.new_zeros(num_out, D) if gathered else x.new_empty(S, D)
        u1_SR = x.new_empty(S, lr1.rank) if lr1 is not None else None
        u2_SR = x.new_empty(S, lr2.rank) if lr2 is not None else None

        def scratch():
            return {"x": x.new_empty(nmax, D) if gathered else None, "a": x.new_empty(nmax, F)}

        def compute(item, s, y_buf):
            e, lo, hi = item
            n = hi - lo
            xe = torch.index_select(x, 0, token_S[lo:hi], out=s["x"][:n]) if gathered else x[lo:hi]
            he = h_of[e] = torch.mm(xe, _wt(gate_up, e, trans_w))
            if lr1 is not None:
                lowrank_fwd(xe, lr1.a_ERI[e], lr1.b_EOR[e], lr1.scale, he, u1_SR[lo:hi])
            if gu_bias is not None:
                he.add_(gu_bias[e])
            p = None if prob_S is None else prob_S[lo:hi]
            a = act_forward(he, p, act, out=s["a"][:n])
            ye = torch.mm(a, _wt(down, e, trans_w), out=y_buf[:n] if gathered else out[lo:hi])
            if lr2 is not None:
                lowrank_fwd(a, lr2.a_ERI[e], lr2.b_EOR[e], lr2.scale, ye, u2_SR[lo:hi])
            if d_bias is not None:
                ye.add_(d_bias[e]) if p is None else ye.addr_(p, d_bias[e])

        def commit(item, y_buf):
            _, lo, hi = item
            out.index_add_(0, token_S[lo:hi], y_buf[: hi - lo])

        run_experts(
            list(_bounds(counts)),
            compute,
            workers=_num_workers(x, counts, 2 * D * (N + F)),
            make_scratch=scratch,
            commit=commit if gathered else None,
            new_out=lambda: x.new_empty(nmax, D),
        )
        # one h per expert, empty ones too: the number of saved tensors does not depend
        # on the routing (activation checkpointing compares it with the recompute's)
        empty = x.new_empty(0, N)
        ctx.save_for_backward(
            x, prob_S, gate_up, down, gu_bias, d_bias, token_S, u1_SR, u2_SR, *lora[:4],
            *(h_of.get(e, empty) for e in range(len(counts))),
        )  # fmt: skip
        ctx.counts, ctx.cfg, ctx.lora_scales = counts, cfg, lora[4:]
        return out

    @staticmethod
    def backward(ctx, g_out):
        x, prob_S, gate_up, down, gu_bias, d_bias, token_S, u1_SR, u2_SR, *rest = ctx.saved_tensors
        n_lora = 4 if ctx.lora_scales else 0  # (a1, b1, a2, b2) when LoRA factors came in
        ABAB, hs = rest[:n_lora], rest[n_lora:]
        # h is unpacked above and its storage is the loop's own; with the graph freed
        # after this node anyway, each expert's h goes as soon as it has been read
        release = _graph_released() and not _modes_active()
        act, trans_w, _ = ctx.cfg
        lr1, lr2 = _lowranks((*ABAB, *ctx.lora_scales))
        ABAB = ABAB or (None,) * 4
        need = ctx.needs_input_grad
        counts = ctx.counts
        g_out = g_out.contiguous()
        D = x.shape[1]
        N = gate_up.shape[1] if trans_w else gate_up.shape[2]
        F = N // 2 if act.gated else N
        nmax = max(counts, default=0)
        gathered = token_S is not None
        gx = None
        if need[0]:
            gx = torch.zeros_like(x) if gathered else torch.empty_like(x)
        gp = prob_S.new_zeros(prob_S.shape) if prob_S is not None and need[1] else None
        # weight gradients: every expert's slice is written by an mm(out=) below; only
        # experts without tokens need zeros (zero-filling the whole [E, ...] costs ~10%)
        ggu = _empty_grad(gate_up, counts) if need[2] else None
        gd = _empty_grad(down, counts) if need[3] else None
        ggb = torch.zeros_like(gu_bias) if gu_bias is not None and need[4] else None
        gdb = torch.zeros_like(d_bias) if d_bias is not None and need[5] else None
        g1a, g1b, g2a, g2b = (
            _empty_grad(t, counts) if t is not None and need[9 + i] else None
            for i, t in enumerate(ABAB)
        )

        def scratch():
            def rows(k):
                return x.new_empty(nmax, k)

            # "rows": the gathered gy, then (once gy is used up) the gathered x;
            # act[0] is free once act_parts returns: ap, then the prob gradient's product
            return {
                "rows": rows(D) if gathered else None,
                "da": rows(F),
                "dh": rows(N),
                "act": [rows(F) for _ in range(4)],
            }

        def compute(item, s, dx_buf):
            e, lo, hi = item
            n = hi - lo
            idx = token_S[lo:hi] if gathered else None
            gy = torch.index_select(g_out, 0, idx, out=s["rows"][:n]) if gathered else g_out[lo:hi]
            p = None if prob_S is None else prob_S[lo:hi]
            act_bufs = [b[:n] for b in s["act"]]
            a0, d_gate, d_up = act_parts(hs[e], act, act_bufs)
            if release:
                _free(hs[e])
            if gd is not None or g2a is not None:
                ap = a0 if p is None else torch.mul(a0, p.unsqueeze(1), out=act_bufs[0])
            if gd is not None:
                # y = ap @ W^T: dW = gy^T ap ([D, F]); y = ap @ W: dW = ap^T gy ([F, D])
                torch.mm(gy.t(), ap, out=gd[e]) if trans_w else torch.mm(ap.t(), gy, out=gd[e])
            if gdb is not None:
                torch.mv(gy.t(), p, out=gdb[e]) if p is not None else torch.sum(gy, 0, out=gdb[e])
            da = torch.mm(gy, _wt(down, e, trans_w).t(), out=s["da"][:n])
            if lr2 is not None:
                xa = ap if g2a is not None else None
                gu = lowrank_bwd(
                    gy, xa, u2_SR[lo:hi], lr2.b_EOR[e], lr2.scale, _at(g2a, e), _at(g2b, e)
                )
                da.addmm_(gu, lr2.a_ERI[e])
            if gp is not None:
                gpe = gp[lo:hi]
                torch.sum(torch.mul(da, a0, out=act_bufs[0]), 1, out=gpe)
                if d_bias is not None:
                    gpe.add_(torch.mv(gy, d_bias[e]))
            if p is not None:
                da.mul_(p.unsqueeze(1))
            dh = act_input_grad(da, d_gate, d_up, act.interleaved, s["dh"][:n])
            if ggb is not None:
                torch.sum(dh, 0, out=ggb[e])
            if ggu is not None or g1a is not None:
                xe = torch.index_select(x, 0, idx, out=s["rows"][:n]) if gathered else x[lo:hi]
            if ggu is not None:
                torch.mm(dh.t(), xe, out=ggu[e]) if trans_w else torch.mm(xe.t(), dh, out=ggu[e])
            if lr1 is not None:
                xa = xe if g1a is not None else None
                gu = lowrank_bwd(
                    dh, xa, u1_SR[lo:hi], lr1.b_EOR[e], lr1.scale, _at(g1a, e), _at(g1b, e)
                )
            if gx is not None:
                w_in = _wt(gate_up, e, trans_w).t()  # [2F, D]
                dx = torch.mm(dh, w_in, out=dx_buf[:n] if gathered else gx[lo:hi])
                if lr1 is not None:
                    dx.addmm_(gu, lr1.a_ERI[e])

        def commit(item, dx_buf):
            _, lo, hi = item
            gx.index_add_(0, token_S[lo:hi], dx_buf[: hi - lo])

        run_experts(
            list(_bounds(counts)),
            compute,
            workers=_num_workers(x, counts, 4 * D * (N + F)),
            make_scratch=scratch,
            commit=commit if gathered and gx is not None else None,
            new_out=lambda: x.new_empty(nmax, D),
        )
        grads = (gx, gp, ggu, gd, ggb, gdb, None, None, None)
        return grads + ((g1a, g1b, g2a, g2b, None) if ctx.lora_scales else ())
