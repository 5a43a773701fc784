"""Every expert activation's math, once: forward, the parts backward recomputes, backward.

An activation kind names the elementwise function f applied between the two expert
projections: gated experts compute f(gate) * up from the [gate | up] (or interleaved)
output of the first projection, non-gated ones f(h). The built-in kinds and their
formulas are the table `specs.ACTIVATION_KINDS` ("swiglu": f = silu, the historical name
of the gated form).

Any other elementwise function can be registered (`register_elementwise`); its
derivative is taken with autograd on the elementwise function alone, inside the
memory-lean backward, so it still saves only the first projection's output.

Every torch path calls the three functions below, in the dtype it hands them:
`act_forward` (a = act * prob), `act_parts` (a0 = act without prob, d a0/d gate,
d a0/d up: what a backward recomputes from the kept h) and `act_input_grad` (dh from
those parts). The per-expert loop runs them in place in the activation dtype; the eager
row ops (`act_fwd_eager` / `act_bwd_eager`, also the FP8 MLP's torch path) run them in
fp32 and round once. `reference.activation_reference` is the specification
of every kind; the Triton device functions of `activation_kernels.py` compute the same math.
"""

# n rows, F expert hidden dim

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..specs import KERNEL_KINDS, ActivationConfig, register_activation_kind

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

#: the gated kinds with hand-fused in-place forms (and kernels among the row ops)
ACTIVATIONS = ("swiglu", "gpt_oss")
GPT_OSS = ActivationConfig("gpt_oss")  # the alpha/limit defaults


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def _relu2(x):
    return F.relu(x).square()


def _d_silu(x):
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _d_gelu(x):
    cdf = 0.5 * (1 + torch.erf(x * _INV_SQRT_2))
    return cdf + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _d_gelu_tanh(x):
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x.pow(3))
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)


def _d_relu2(x):
    return 2 * F.relu(x)


#: kind -> (f, f') for the built-in elementwise kinds with analytic derivatives
BUILTIN: dict[str, tuple[Callable, Callable]] = {
    "swiglu": (F.silu, _d_silu),
    "gelu": (F.gelu, _d_gelu),
    "gelu_tanh": (_gelu_tanh, _d_gelu_tanh),
    "relu2": (_relu2, _d_relu2),
}
#: elementwise kinds registered at run time: kind -> f (derivative by autograd)
REGISTERED: dict[str, Callable] = {}


def register_elementwise(kind: str, fn: Callable, formula: str) -> None:
    """Make `kind` an activation computing fn(gate) * up (gated) or fn(h) (non-gated).

    `fn` must be elementwise, parameter-free and differentiable by autograd."""
    if not isinstance(kind, str) or not kind or kind in KERNEL_KINDS or kind in REGISTERED:
        raise ValueError(f"activation kind {kind!r}: need a new non-empty name")
    if not callable(fn):
        raise TypeError(f"register_elementwise({kind!r}): fn must be callable, got {fn!r}")
    REGISTERED[kind] = fn
    register_activation_kind(kind, formula)


def is_elementwise_kind(kind: str) -> bool:
    """True for the kinds computed through an elementwise f (all but "gpt_oss")."""
    return kind in BUILTIN or kind in REGISTERED or kind == "swiglu_clamp"


def check_supported(act: ActivationConfig) -> ActivationConfig:
    """Raise ValueError for a kind of the table these ops do not compute (one added to
    `ACTIVATION_KINDS` other than by `register_elementwise`)."""
    if act.kind != "gpt_oss" and not is_elementwise_kind(act.kind):
        raise ValueError(
            f"activation.kind={act.kind!r} has no implementation in dropless.ops; register "
            "an elementwise function with dropless.ops.activation.eager.register_elementwise"
        )
    return act


def split_gate_up(h, gated: bool, interleaved: bool):
    """(gate, up) views of h; (h, None) for a non-gated activation."""
    if not gated:
        return h, None
    if interleaved:
        return h[:, 0::2], h[:, 1::2]
    n = h.shape[-1] // 2
    return h[:, :n], h[:, n:]


def _is_glu(act: ActivationConfig) -> bool:
    """The two kinds with hand-fused in-place forms; the others go through f and f'."""
    return act.gated and act.kind in ACTIVATIONS


# --- the math of every kind (in the dtype it is given; into buffers when handed) -----


def act_forward(h_n2F, prob_n, act: ActivationConfig, out=None):
    """a = act(gate, up) * prob (prob None: 1), written into `out` when given; h is
    not modified."""
    gate, up = split_gate_up(h_n2F, act.gated, act.interleaved)
    alpha, limit = act.alpha, act.limit
    if not _is_glu(act):
        a = elementwise_fwd(gate, up, act.kind, limit)
        a = out.copy_(a) if out is not None else a
    elif act.kind == "swiglu":
        a = torch.ops.aten.silu.out(gate, out=out) if out is not None else F.silu(gate)
        a.mul_(up)
    else:
        g = gate.clamp(max=limit)
        a = torch.mul(g, alpha, out=out) if out is not None else g * alpha
        a.sigmoid_().mul_(g).mul_(up.clamp(-limit, limit).add_(1))
    if prob_n is not None:
        a.mul_(prob_n.unsqueeze(1))
    return a


def act_parts(h_n2F, act: ActivationConfig, bufs=None):
    """What a backward recomputes from the kept h: (a0 = act without prob, d a0/d gate,
    d a0/d up); d_up is None for non-gated experts (gate is then the whole h). `bufs`:
    four [n, F] buffers the gated SwiGLU writes into instead of allocating (the first is
    free for the caller once this returns)."""
    gate, up = split_gate_up(h_n2F, act.gated, act.interleaved)
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


def act_input_grad(g_nF, d_gate, d_up, interleaved: bool, out_n2F):
    """dh = [g * d a0/d gate, g * d a0/d up] in the layout of h (g * d a0/d h if d_up
    is None: non-gated), written into out_n2F; g already carries the prob."""
    if d_up is None:
        return torch.mul(g_nF, d_gate, out=out_n2F)
    og, ou = split_gate_up(out_n2F, True, interleaved)
    if torch.compiler.is_compiling():
        # Dynamo breaks the graph on an out= view that is not contiguous; copy_ is the
        # same values (the product is rounded once to out's dtype either way)
        og.copy_(g_nF * d_gate)
        ou.copy_(g_nF * d_up)
        return out_n2F
    torch.mul(g_nF, d_gate, out=og)
    torch.mul(g_nF, d_up, out=ou)
    return out_n2F


def act_backward(
    g_SF,
    h_S2F,
    prob_S,
    act: ActivationConfig,
    *,
    need_prob_grad=True,
    recompute=False,
):
    """(grad_h, grad_prob or None, the forward output or None) with the math in fp32
    (fp64 for fp64); grad_h and the forward output (act * prob, for the down projection's
    weight grad, with `recompute`) in h's dtype."""
    acc = torch.promote_types(h_S2F.dtype, torch.float32)
    a0, d_gate, d_up = act_parts(h_S2F.to(acc), act)
    g = g_SF.to(acc)
    grad_p = a = None
    if prob_S is not None:
        p = prob_S.to(acc).unsqueeze(1)
        if need_prob_grad:
            grad_p = (g * a0).sum(1).to(prob_S.dtype)
        g = g * p
        if recompute:
            a = (a0 * p).to(h_S2F.dtype)
    elif recompute:
        a = a0.to(h_S2F.dtype)
    grad_h = h_S2F.new_empty(h_S2F.shape)
    return act_input_grad(g, d_gate, d_up, act.interleaved, grad_h), grad_p, a


# --- the eager row ops' form (the `RowOps` signature): fp32 math, rounded once ---------


def act_fwd_eager(
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None = None,
    interleaved: bool = False,
    activation: str = "swiglu",
    alpha: float = GPT_OSS.alpha,
    limit: float = GPT_OSS.limit,
) -> torch.Tensor:
    """act(gate, up) * prob (prob = 1 when None), fp32 math, in h's dtype; no autograd."""
    acc = torch.promote_types(h_S2F.dtype, torch.float32)
    act = ActivationConfig(activation, interleaved=interleaved, alpha=alpha, limit=limit)
    p = None if prob_S is None else prob_S.to(acc)
    return act_forward(h_S2F.to(acc), p, act).to(h_S2F.dtype)


def act_bwd_eager(
    grad_SF: torch.Tensor,
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None = None,
    interleaved: bool = False,
    need_prob_grad: bool = True,
    recompute: bool = False,
    activation: str = "swiglu",
    alpha: float = GPT_OSS.alpha,
    limit: float = GPT_OSS.limit,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward of `act_fwd_eager`: (grad_h, grad_prob or None, the forward output or None).

    grad_prob when prob_S is given and need_prob_grad; with recompute the forward output
    (act * prob, for the down projection's weight grad) comes back too. fp32 math.
    """
    act = ActivationConfig(activation, interleaved=interleaved, alpha=alpha, limit=limit)
    return act_backward(
        grad_SF, h_S2F, prob_S, act, need_prob_grad=need_prob_grad, recompute=recompute
    )


class ElementwiseAct(torch.autograd.Function):
    """act(h) * prob for an elementwise kind in h's dtype; saves h and prob only
    (recomputes in backward)."""

    @staticmethod
    def forward(ctx, h, prob_S, act: ActivationConfig):
        a = act_forward(h, None, act)
        if prob_S is not None:
            a = a * prob_S.unsqueeze(1).to(a.dtype)
        ctx.save_for_backward(h, prob_S)
        ctx.act = act
        return a

    @staticmethod
    def backward(ctx, g):
        h, prob_S = ctx.saved_tensors
        a0, d_gate, d_up = act_parts(h, ctx.act)
        grad_prob = None
        if prob_S is not None:
            if ctx.needs_input_grad[1]:
                grad_prob = (g * a0).sum(-1).to(prob_S.dtype)
            g = g * prob_S.unsqueeze(1).to(g.dtype)
        return (
            act_input_grad(g, d_gate, d_up, ctx.act.interleaved, torch.empty_like(h)),
            grad_prob,
            None,
        )


# --- elementwise kinds: f and f' --------------------------------------------------------


def _value_and_derivative(kind: str, x: torch.Tensor):
    if kind in BUILTIN:
        f, df = BUILTIN[kind]
        return f(x), df(x)
    fn = REGISTERED[kind]
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        y = fn(xg)
        (d,) = torch.autograd.grad(y, xg, torch.ones_like(y))
    return y.detach(), d


def elementwise_fwd(gate, up, kind: str, limit: float):
    """a0 = f(gate) * up, or f(gate) when up is None (non-gated)."""
    if kind == "swiglu_clamp":
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    if kind in BUILTIN:
        a = BUILTIN[kind][0](gate)
    else:
        with torch.no_grad():
            a = REGISTERED[kind](gate)
    return a if up is None else a * up


def elementwise_parts(gate, up, kind: str, limit: float):
    """(a0, d a0/d gate, d a0/d up); d_up is None when up is None (non-gated)."""
    if kind == "swiglu_clamp":
        g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
        f, df = F.silu(g), _d_silu(g)
        # torch.clamp passes the gradient where min <= x <= max (inclusive)
        d_gate = df.mul_(u).mul_(gate <= limit)
        return f * u, d_gate, f.mul_((up >= -limit) & (up <= limit))
    f, df = _value_and_derivative(kind, gate)
    if up is None:
        return f, df, None
    return f * up, df.mul_(up), f
