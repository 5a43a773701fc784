"""Activation pieces shared by the two fused expert-MLP Functions (no autograd):
the forward activation times the routing prob, its recomputed parts for backward, and
the gradient through it, each in place where the caller hands buffers."""

# n rows of one expert (or all S sorted rows), F expert hidden dim, 2F gated width

from __future__ import annotations

import torch

from .activations import elementwise_fwd, elementwise_parts
from .specs import ActivationConfig
from .swiglu import _split


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


def _act_parts(h_n2F, act: ActivationConfig, bufs=None):
    """Recompute the activation: (a0 = act without prob, d a0/d gate, d a0/d up);
    d_up is None for non-gated experts (gate is then the whole h). `bufs`: four [n, F]
    buffers the gated SwiGLU writes into instead of allocating (the first is free for
    the caller once this returns)."""
    gate, up = _gate_up(h_n2F, act)
    alpha, limit = act.alpha, act.limit
    if not _is_glu(act):
        return elementwise_parts(gate, up, act.kind, limit)
    if act.kind == "swiglu" and bufs is not None:
        sig, silu, a0, d_gate = bufs
        torch.sigmoid(gate, out=sig)
        torch.mul(gate, sig, out=silu)
        torch.mul(silu, up, out=a0)
        torch.addcmul(a0, sig, torch.sub(up, a0, out=d_gate), out=d_gate)  # as below
        return a0, d_gate, silu
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
