"""Expert activations beyond SwiGLU: values and derivatives without autograd.

An activation kind names the elementwise function f applied between the two expert
projections: gated experts compute f(gate) * up from the [gate | up] (or interleaved)
output of the first projection, non-gated ones f(h). Built in:

- "swiglu": f = silu (the historical name of the gated form);
- "gelu": exact GELU, x * Phi(x); "gelu_tanh": GELU with the tanh approximation;
- "relu2": relu(x)^2;
- "swiglu_clamp": silu(min(gate, limit)) * clamp(up, -limit, limit) (gated only);
- "gpt_oss": GPT-OSS's clamped GLU (implemented in `fused_mlp` / `swiglu`).

Any other elementwise function can be registered (`register_elementwise`); its
derivative is taken with autograd on the elementwise function alone, inside the
memory-lean backward, so it still saves only the first projection's output.
`dropless.ops.reference.activation_reference` is the specification of every kind.
"""

# n rows, F expert hidden dim

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .specs import ACTIVATION_KINDS, register_activation_kind

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


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
FORMULAS = {
    "swiglu": "silu(gate) * up (non-gated: silu(h))",
    "gelu": "gelu(gate) * up, exact erf GELU (non-gated: gelu(h))",
    "gelu_tanh": "gelu_tanh(gate) * up, tanh-approximated GELU (non-gated: gelu_tanh(h))",
    "relu2": "relu(gate)^2 * up (non-gated: relu(h)^2)",
    "swiglu_clamp": "silu(min(gate, limit)) * clamp(up, -limit, limit)",
}
#: elementwise kinds registered at run time: kind -> f (derivative by autograd)
REGISTERED: dict[str, Callable] = {}

for _kind, _formula in FORMULAS.items():
    if _kind not in ACTIVATION_KINDS:
        register_activation_kind(_kind, _formula)


def register_elementwise(kind: str, fn: Callable, formula: str) -> None:
    """Make `kind` an activation computing fn(gate) * up (gated) or fn(h) (non-gated).

    `fn` must be elementwise, parameter-free and differentiable by autograd."""
    if not isinstance(kind, str) or not kind or kind in FORMULAS or kind == "gpt_oss":
        raise ValueError(f"activation kind {kind!r}: need a new non-empty name")
    if not callable(fn):
        raise TypeError(f"register_elementwise({kind!r}): fn must be callable, got {fn!r}")
    REGISTERED[kind] = fn
    FORMULAS[kind] = formula
    register_activation_kind(kind, formula)


def is_elementwise_kind(kind: str) -> bool:
    """True for the kinds this module computes (all but "gpt_oss")."""
    return kind in BUILTIN or kind in REGISTERED or kind == "swiglu_clamp"


def act_value(h, kind: str, gated: bool, interleaved: bool, limit: float):
    """a0 of an elementwise kind on h (gate/up split as the layout says)."""
    gate, up = _split(h, gated, interleaved)
    return elementwise_fwd(gate, up, kind, limit)


def _split(h, gated: bool, interleaved: bool):
    if not gated:
        return h, None
    if interleaved:
        return h[:, 0::2], h[:, 1::2]
    n = h.shape[-1] // 2
    return h[:, :n], h[:, n:]


class ElementwiseAct(torch.autograd.Function):
    """act(h) * prob for an elementwise kind; saves h and prob only (recomputes in backward)."""

    @staticmethod
    def forward(ctx, h, prob_S, kind, gated, interleaved, limit):
        a = act_value(h, kind, gated, interleaved, limit)
        if prob_S is not None:
            a = a * prob_S.unsqueeze(1).to(a.dtype)
        ctx.save_for_backward(h, prob_S)
        ctx.args = (kind, gated, interleaved, limit)
        return a

    @staticmethod
    def backward(ctx, g):
        h, prob_S = ctx.saved_tensors
        kind, gated, interleaved, limit = ctx.args
        gate, up = _split(h, gated, interleaved)
        a0, d_gate, d_up = elementwise_parts(gate, up, kind, limit)
        grad_prob = None
        if prob_S is not None:
            if ctx.needs_input_grad[1]:
                grad_prob = (g * a0).sum(-1).to(prob_S.dtype)
            g = g * prob_S.unsqueeze(1).to(g.dtype)
        if d_up is None:
            return g * d_gate, grad_prob, None, None, None, None
        dh = torch.empty_like(h)
        dg, du = _split(dh, True, interleaved)
        torch.mul(g, d_gate, out=dg)
        torch.mul(g, d_up, out=du)
        return dh, grad_prob, None, None, None, None


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
