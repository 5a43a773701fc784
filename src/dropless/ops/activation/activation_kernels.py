"""The math of every expert activation kind, once, as Triton device functions.

Every Triton kernel that applies an expert activation calls these (the row ops of
`swiglu_kernels.py`, the fused SwiGLU + FP8 quantize of `swiglu_quant_kernels.py`
and its backward, `swiglu_bwd_quant_kernels.py`),
so a kind's formula and its derivative are written here and nowhere else on the Triton
side. The specification is `reference.activation_reference`; the torch
forms are in `eager.py`. Math in fp32; `KIND` is a `tl.constexpr` string, so each
kind compiles to its own straight-line code (no branch at run time).

- `elementwise(x, KIND) -> (f(x), f'(x))` for the kinds with an elementwise f ("swiglu",
  "gelu", "gelu_tanh", "relu2"; formulas: `specs.ACTIVATION_KINDS`). A non-gated expert
  computes f(h).
- `glu(gate, up, alpha, limit, KIND) -> (act, d act/d gate, d act/d up)` for every
  gated kind (f(gate) * up for the elementwise kinds, "swiglu_clamp", "gpt_oss").
  Through a clamp the gradient passes where min <= x <= max, as torch.clamp's. `act`
  excludes the routing weight. `alpha` is read by "gpt_oss", `limit` by the clamped kinds.
- `glu_fwd(gate, up, alpha, limit, KIND) -> act` alone (the compiler drops the
  derivative's instructions).

gelu_tanh uses tanh(z) = 2 * sigmoid(2z) - 1 (Triton's core language has no tanh), in
the forms that need no cancellation: 0.5 * (1 + tanh(z)) = sigmoid(2z) and
1 - tanh(z)^2 = 4 * s * (1 - s).
"""

# x, gate, up: fp32 tiles of one shape

from __future__ import annotations

import math

import triton
import triton.language as tl

from ..specs import KERNEL_KINDS

#: the kinds `glu` computes (all gated); `elementwise` computes the first four
KINDS = KERNEL_KINDS
ELEMENTWISE_KINDS = KINDS[:4]

# a jit function reads a global only when it is a constexpr
_INV_SQRT_2 = tl.constexpr(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
_SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
_GELU_TANH_C = tl.constexpr(0.044715)


@triton.jit
def _silu(x):
    sig = tl.sigmoid(x)
    return x * sig, sig * (1.0 + x * (1.0 - sig))


@triton.jit
def _gelu(x):
    cdf = 0.5 * (1.0 + tl.erf(x * _INV_SQRT_2))
    return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI


@triton.jit
def _gelu_tanh(x):
    inner = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x * x * x)
    s = tl.sigmoid(2.0 * inner)  # 0.5 * (1 + tanh(inner))
    d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * x * x)
    return x * s, s + 2.0 * x * s * (1.0 - s) * d_inner


@triton.jit
def _relu2(x):
    r = tl.maximum(x, 0.0)
    return r * r, 2.0 * r


@triton.jit
def elementwise(x, KIND: tl.constexpr):
    """(f(x), f'(x)) in fp32 for KIND in ELEMENTWISE_KINDS."""
    if KIND == "swiglu":
        f, df = _silu(x)
    elif KIND == "gelu":
        f, df = _gelu(x)
    elif KIND == "gelu_tanh":
        f, df = _gelu_tanh(x)
    else:
        f, df = _relu2(x)
    return f, df


@triton.jit
def _gpt_oss(gate, up, alpha, limit):
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    sig = tl.sigmoid(alpha * g)
    glu = g * sig
    act = glu * (u + 1.0)
    d_glu = tl.where(gate <= limit, sig + alpha * g * sig * (1.0 - sig), 0.0)
    d_gate = (u + 1.0) * d_glu
    d_up = tl.where((up >= -limit) & (up <= limit), glu, 0.0)
    return act, d_gate, d_up


@triton.jit
def _swiglu_clamp(gate, up, limit):
    u = tl.minimum(tl.maximum(up, -limit), limit)
    f, df = _silu(tl.minimum(gate, limit))
    d_gate = tl.where(gate <= limit, u * df, 0.0)
    d_up = tl.where((up >= -limit) & (up <= limit), f, 0.0)
    return f * u, d_gate, d_up


@triton.jit
def glu(gate, up, alpha, limit, KIND: tl.constexpr):
    """(act, d act/d gate, d act/d up) in fp32 for KIND in KINDS; act excludes the prob."""
    if KIND == "gpt_oss":
        act, d_gate, d_up = _gpt_oss(gate, up, alpha, limit)
    elif KIND == "swiglu_clamp":
        act, d_gate, d_up = _swiglu_clamp(gate, up, limit)
    else:
        f, df = elementwise(gate, KIND)
        act = f * up
        d_gate = up * df
        d_up = f
    return act, d_gate, d_up


@triton.jit
def glu_fwd(gate, up, alpha, limit, KIND: tl.constexpr):
    """act = glu(...)[0]: the forward alone."""
    act, _, _ = glu(gate, up, alpha, limit, KIND)
    return act
