"""Memory-lean expert MLP: permute -> gate/up GEMM -> SwiGLU x prob -> down GEMM ->
combine as ONE autograd Function that owns its backward.

Saved for backward, per kept (token, expert) pair (S of them): the gate/up output
h [2F] in the activation dtype, the routing prob (one value) and two int64 indices
(token, pair). Plus x_TD, which the caller holds anyway, and nothing else: the
gathered input x[token_S] and the SwiGLU output are recomputed in backward, and the
expert outputs are never kept. The composed path (`grouped_gemm` + `swiglu` +
`unpermute` autograd nodes) keeps x_SD [D], h [2F], the activation [F] and y [D] per
pair: at D=1024, F=384 that is 2816 values per pair against 768 here (3.7x less).

Two implementations of the same Function, picked by `pick_mlp_path`:

- `_LoopMLP` (the CPU default): one pass per expert that gathers that expert's rows
  into a small buffer, runs both GEMMs with `torch.mm(out=)`, applies SwiGLU x prob in
  place and `index_add_`s the result into the output (an expert sees a token at most
  once, and experts are visited in order, so the sum is deterministic). Backward does
  the same per expert and writes the weight gradients straight into preallocated
  [E, ...] tensors. The working set of one expert stays in cache, and no [S, D]
  tensor is ever allocated. Needs the per-expert counts on the host (one sync per
  layer, in `sort_by_expert`). Runs any dtype, fp64 included.
- `_GroupedMLP`: whole-S gathers and grouped GEMMs through a registered backend
  (`grouped_mm`, `triton`, ...), with the same saved tensors. Given the counts as a
  device tensor and the `grouped_mm` backend (offsets computed on the device), it
  never syncs with the host: the path used on CUDA and under `torch.compile`.

Both handle biases (the down bias is scaled by the prob), `activation="gpt_oss"`,
interleaved gate/up, `trans_w=False` and dropped pairs (capacity mode: the caller's
SortedPairs leave them out). Low-precision recipes never come here (see expert_mlp.py).
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted (kept) pairs

from __future__ import annotations

import torch

from .activations import elementwise_fwd, elementwise_parts
from .dispatch import pick_gemm_backend
from .permute import gather_sum
from .specs import ActivationConfig, as_activation
from .swiglu import _split, check_supported

# --- activation pieces (no autograd; shared by both Functions) -----------------------


def _gate_up(h, act: ActivationConfig):
    return _split(h, act.interleaved) if act.gated else (h, None)


def _is_glu(act: ActivationConfig) -> bool:
    """The two kinds with hand-fused in-place forms; the others are in `activations`."""
    return act.gated and act.kind in ("swiglu", "gpt_oss")


def _act_fwd(h_n2F, prob_n, act: ActivationConfig, out=None):
    """a = act(gate, up) * prob, written into `out` when given."""
    gate, up = _gate_up(h_n2F, act)
    alpha, limit = act.alpha, act.limit
    if not _is_glu(act):
        a = elementwise_fwd(gate, up, act.kind, limit)
        a = out.copy_(a) if out is not None else a
    elif act.kind == "swiglu":
        a = (
            torch.ops.aten.silu.out(gate, out=out)
            if out is not None
            else torch.nn.functional.silu(gate)
        )
        a.mul_(up)
    else:
        g = gate.clamp(max=limit)
        a = torch.mul(g, alpha, out=out) if out is not None else g * alpha
        a.sigmoid_().mul_(g).mul_(up.clamp(-limit, limit).add_(1))
    if prob_n is not None:
        a.mul_(prob_n.unsqueeze(1))
    return a


def _act_parts(h_n2F, act: ActivationConfig):
    """Recompute the activation: (a0 = act without prob, d a0/d gate, d a0/d up);
    d_up is None for non-gated experts (gate is then the whole h)."""
    gate, up = _gate_up(h_n2F, act)
    alpha, limit = act.alpha, act.limit
    if not _is_glu(act):
        return elementwise_parts(gate, up, act.kind, limit)
    if act.kind == "swiglu":
        sig = torch.sigmoid(gate)
        silu = gate * sig
        a0 = silu * up
        # d a0/d gate = up * sig * (1 + gate * (1 - sig)) = a0 + sig * (up - a0): 2 passes
        d_gate = torch.addcmul(a0, sig, up - a0)
        return a0, d_gate, silu
    g = gate.clamp(max=limit)
    u1 = up.clamp(-limit, limit).add_(1)
    s = torch.sigmoid(g * alpha)
    glu = g * s
    a0 = glu * u1
    # torch.clamp passes the gradient where min <= x <= max (inclusive)
    d_gate = torch.rsub(s, 1).mul_(g).mul_(alpha).add_(1).mul_(s).mul_(u1).mul_(gate <= limit)
    d_up = glu.mul_((up >= -limit) & (up <= limit))
    return a0, d_gate, d_up


def _act_bwd(g_nF, d_gate, d_up, interleaved, out_n2F):
    """dh = [g * d a0/d gate, g * d a0/d up] in the layout of h (g * d a0/d h if d_up
    is None: non-gated)."""
    if d_up is None:
        return torch.mul(g_nF, d_gate, out=out_n2F)
    og, ou = _split(out_n2F, interleaved)
    torch.mul(g_nF, d_gate, out=og)
    torch.mul(g_nF, d_up, out=ou)
    return out_n2F


def _wt(w, e, trans_w):
    """The [in, out] operand of expert e: w[e]^T for the nn.Linear layout, else w[e]."""
    return w[e].t() if trans_w else w[e]


def _bounds(counts):
    lo = 0
    for e, n in enumerate(counts):
        if n:
            yield e, lo, lo + n
        lo += n


# --- per-expert loop (CPU default) --------------------------------------------------


def _empty_grad(w: torch.Tensor, counts) -> torch.Tensor:
    g = torch.empty_like(w, memory_format=torch.contiguous_format)
    for e, n in enumerate(counts):
        if not n:
            g[e].zero_()
    return g


class _LoopMLP(torch.autograd.Function):
    """x (x_TD with token_S, or x_SD when token_S is None) -> out_TD (or y_SD)."""

    @staticmethod
    def forward(ctx, x, prob_S, gate_up, down, gu_bias, d_bias, token_S, counts, cfg):
        act, trans_w, num_out = cfg
        S, D = int(sum(counts)), x.shape[1]
        N = gate_up.shape[1] if trans_w else gate_up.shape[2]  # 2F gated, F not
        F = N // 2 if act.gated else N
        nmax = max(counts, default=0)
        h_S2F = x.new_empty(S, N)
        a_buf, y_buf = x.new_empty(nmax, F), x.new_empty(nmax, D)
        x_buf = x.new_empty(nmax, D) if token_S is not None else None
        out = x.new_zeros(num_out, D) if token_S is not None else x.new_empty(S, D)
        for e, lo, hi in _bounds(counts):
            n = hi - lo
            xe = (
                torch.index_select(x, 0, token_S[lo:hi], out=x_buf[:n])
                if token_S is not None
                else x[lo:hi]
            )
            he = torch.mm(xe, _wt(gate_up, e, trans_w), out=h_S2F[lo:hi])
            if gu_bias is not None:
                he.add_(gu_bias[e])
            p = None if prob_S is None else prob_S[lo:hi]
            a = _act_fwd(he, p, act, out=a_buf[:n])
            ye = torch.mm(
                a, _wt(down, e, trans_w), out=y_buf[:n] if token_S is not None else out[lo:hi]
            )
            if d_bias is not None:
                ye.add_(d_bias[e]) if p is None else ye.addr_(p, d_bias[e])
            if token_S is not None:
                out.index_add_(0, token_S[lo:hi], ye)
        ctx.save_for_backward(x, prob_S, gate_up, down, gu_bias, d_bias, token_S, h_S2F)
        ctx.counts, ctx.cfg = counts, cfg
        return out

    @staticmethod
    def backward(ctx, g_out):
        x, prob_S, gate_up, down, gu_bias, d_bias, token_S, h_S2F = ctx.saved_tensors
        act, trans_w, _ = ctx.cfg
        need = ctx.needs_input_grad
        counts = ctx.counts
        g_out = g_out.contiguous()
        D, N = x.shape[1], h_S2F.shape[1]
        F = N // 2 if act.gated else N
        nmax = max(counts, default=0)
        gx = torch.zeros_like(x) if need[0] and token_S is not None else None
        if need[0] and token_S is None:
            gx = torch.empty_like(x)
        gp = prob_S.new_zeros(prob_S.shape) if prob_S is not None and need[1] else None
        # weight gradients: every expert's slice is written by an mm(out=) below; only
        # experts without tokens need zeros (zero-filling the whole [E, ...] costs ~10%)
        ggu = _empty_grad(gate_up, counts) if need[2] else None
        gd = _empty_grad(down, counts) if need[3] else None
        ggb = torch.zeros_like(gu_bias) if gu_bias is not None and need[4] else None
        gdb = torch.zeros_like(d_bias) if d_bias is not None and need[5] else None
        gathered = token_S is not None
        x_buf = x.new_empty(nmax, D) if gathered else None
        gy_buf = g_out.new_empty(nmax, D) if gathered else None
        da_buf, ap_buf, dh_buf = (
            x.new_empty(nmax, F),
            x.new_empty(nmax, F),
            x.new_empty(nmax, N),
        )
        for e, lo, hi in _bounds(counts):
            n = hi - lo
            idx = token_S[lo:hi] if gathered else None
            gy = torch.index_select(g_out, 0, idx, out=gy_buf[:n]) if gathered else g_out[lo:hi]
            p = None if prob_S is None else prob_S[lo:hi]
            a0, d_gate, d_up = _act_parts(h_S2F[lo:hi], act)
            if gd is not None:
                ap = a0 if p is None else torch.mul(a0, p.unsqueeze(1), out=ap_buf[:n])
                # y = ap @ W^T: dW = gy^T ap ([D, F]); y = ap @ W: dW = ap^T gy ([F, D])
                torch.mm(gy.t(), ap, out=gd[e]) if trans_w else torch.mm(ap.t(), gy, out=gd[e])
            if gdb is not None:
                torch.mv(gy.t(), p, out=gdb[e]) if p is not None else torch.sum(gy, 0, out=gdb[e])
            da = torch.mm(gy, _wt(down, e, trans_w).t(), out=da_buf[:n])
            if gp is not None:
                gpe = gp[lo:hi]
                torch.sum(da * a0, 1, out=gpe)
                if d_bias is not None:
                    gpe.add_(torch.mv(gy, d_bias[e]))
            if p is not None:
                da.mul_(p.unsqueeze(1))
            dh = _act_bwd(da, d_gate, d_up, act.interleaved, dh_buf[:n])
            if ggb is not None:
                torch.sum(dh, 0, out=ggb[e])
            if ggu is not None:
                xe = torch.index_select(x, 0, idx, out=x_buf[:n]) if gathered else x[lo:hi]
                torch.mm(dh.t(), xe, out=ggu[e]) if trans_w else torch.mm(xe.t(), dh, out=ggu[e])
            if gx is not None:
                w_in = _wt(gate_up, e, trans_w).t()  # [2F, D]
                if gathered:
                    gx.index_add_(0, idx, torch.mm(dh, w_in, out=x_buf[:n]))
                else:
                    torch.mm(dh, w_in, out=gx[lo:hi])
        return gx, gp, ggu, gd, ggb, gdb, None, None, None


# --- whole-S grouped GEMMs through a backend (sync-free with device counts) ----------


def _expert_of_row(counts_E: torch.Tensor, S: int) -> torch.Tensor:
    """The expert of each sorted row, without a host sync (output_size is known)."""
    return torch.repeat_interleave(
        torch.arange(counts_E.numel(), device=counts_E.device), counts_E, output_size=S
    )


class _GroupedMLP(torch.autograd.Function):
    """Same contract as _LoopMLP; counts is a host list or a device tensor."""

    @staticmethod
    def forward(
        ctx, x, prob_S, gate_up, down, gu_bias, d_bias, token_S, slot_TK, counts, cfg, backend
    ):
        act, trans_w, num_out = cfg
        be = pick_gemm_backend(backend, x, gate_up)
        if isinstance(counts, torch.Tensor) and be.name != "grouped_mm":
            counts = counts.tolist()  # only grouped_mm takes device offsets
        x_SD = x.index_select(0, token_S) if token_S is not None else x
        S = x_SD.shape[0]
        rows_E = None
        if gu_bias is not None or d_bias is not None:
            counts_E = (
                counts
                if isinstance(counts, torch.Tensor)
                else torch.tensor(counts, device=x.device)
            )
            rows_E = _expert_of_row(counts_E, S)
        h = be.mm(x_SD, gate_up, counts, trans_w)
        del x_SD  # recomputed in backward
        if gu_bias is not None:
            h += gu_bias.index_select(0, rows_E)
        a = _act_fwd(h, prob_S, act)
        y = be.mm(a, down, counts, trans_w)
        del a
        if d_bias is not None:
            b_SD = d_bias.index_select(0, rows_E)
            y += b_SD if prob_S is None else b_SD * prob_S.unsqueeze(1)
        out = gather_sum(y, slot_TK) if token_S is not None else y
        ctx.save_for_backward(
            x, prob_S, gate_up, down, gu_bias, d_bias, token_S, slot_TK, h, rows_E
        )
        ctx.counts, ctx.cfg, ctx.be = counts, cfg, be
        return out

    @staticmethod
    def backward(ctx, g_out):
        x, prob_S, gate_up, down, gu_bias, d_bias, token_S, slot_TK, h, rows_E = ctx.saved_tensors
        act, trans_w, _ = ctx.cfg
        be, counts, need = ctx.be, ctx.counts, ctx.needs_input_grad
        E = gate_up.shape[0]
        g_out = g_out.contiguous()
        gy = g_out.index_select(0, token_S) if token_S is not None else g_out
        p = None if prob_S is None else prob_S.unsqueeze(1)
        a0, d_gate, d_up = _act_parts(h, act)
        gx = gp = ggu = gd = ggb = gdb = None
        if need[3]:
            ap = a0 if p is None else a0 * p
            gd = be.wgrad(gy, ap, counts) if trans_w else be.wgrad(ap, gy, counts)
            del ap
        if d_bias is not None and need[5]:
            gdb = d_bias.new_zeros(d_bias.shape).index_add_(0, rows_E, gy if p is None else gy * p)
        da = be.mm(gy, down, counts, not trans_w)
        if p is not None and need[1]:
            gp = (da * a0).sum(1)
            if d_bias is not None:
                gp += (gy * d_bias.index_select(0, rows_E)).sum(1)
        del a0
        if p is not None:
            da.mul_(p)
        dh = _act_bwd(da, d_gate, d_up, act.interleaved, torch.empty_like(h))
        del da, d_gate, d_up
        if gu_bias is not None and need[4]:
            ggb = gu_bias.new_zeros(gu_bias.shape).index_add_(0, rows_E, dh)
        if need[2]:
            x_SD = x.index_select(0, token_S) if token_S is not None else x
            ggu = be.wgrad(dh, x_SD, counts) if trans_w else be.wgrad(x_SD, dh, counts)
            del x_SD
        if need[0]:
            dx = be.mm(dh, gate_up, counts, not trans_w)
            gx = gather_sum(dx, slot_TK) if token_S is not None else dx
        if gd is not None and gd.shape[0] != E:  # pragma: no cover - backend contract
            raise AssertionError("wgrad returned the wrong number of groups")
        return gx, gp, ggu, gd, ggb, gdb, None, None, None, None, None


# --- entry point ----------------------------------------------------------------------

PATHS = ("loop", "grouped")


def pick_mlp_path(x: torch.Tensor, w: torch.Tensor, backend: str | None) -> str | None:
    """Which fused path runs these operands: "loop", "grouped", or None (composed path).

    auto: the per-expert loop on CPU (measured fastest there, see docs/performance.md),
    the grouped GEMM path elsewhere. backend="loop" forces the loop, "grouped_mm" the
    grouped path; other backends (e.g. "triton") use the grouped path with that backend.
    """
    if backend == "loop":
        return "loop"
    if backend in (None, "auto"):
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            return "loop"
        return "grouped"
    return "grouped"


def fused_mlp(
    x: torch.Tensor,
    prob_S: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts,
    *,
    token_S: torch.Tensor | None = None,
    slot_TK: torch.Tensor | None = None,
    num_out: int | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ActivationConfig | str | None = None,
    interleaved: bool | None = None,
    trans_w: bool = True,
    alpha: float | None = None,
    limit: float | None = None,
    path: str = "loop",
    backend: str | None = None,
) -> torch.Tensor:
    """The fused expert MLP (internal; callers use `expert_mlp` / `grouped_mlp`).

    With token_S/slot_TK (from SortedPairs), x is x_TD and the result is the combined
    out [num_out, D]; without, x is x_SD (sorted rows) and the result is y_SD.
    counts: host list (required by path "loop") or device tensor (path "grouped").
    `activation`: an ActivationConfig, or a kind name with interleaved/alpha/limit.
    """
    if prob_S is not None:
        prob_S = prob_S.to(x.dtype)
    act = check_supported(
        as_activation(activation, interleaved=interleaved, alpha=alpha, limit=limit)
    )
    cfg = (act, bool(trans_w), num_out)
    if path == "loop":
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()  # host sync: the loop needs the bounds on the host
        return _LoopMLP.apply(
            x, prob_S, gate_up, down, gate_up_bias, down_bias, token_S, list(counts), cfg
        )
    be = None if backend in (None, "auto", "loop") else backend
    return _GroupedMLP.apply(
        x, prob_S, gate_up, down, gate_up_bias, down_bias, token_S, slot_TK, counts, cfg, be
    )
