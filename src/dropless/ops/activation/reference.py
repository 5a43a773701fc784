"""The expert activations by their definition (autograd through torch ops): the
specification of `activation.eager`, `swiglu` and the Triton activation math.
"""

# S rows, F expert hidden dim, N features

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..specs import ActivationConfig, as_activation


def activation_reference(
    h_SN: torch.Tensor,
    kind: str = "swiglu",
    *,
    gated: bool = True,
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    fn=None,
):
    """The expert activation by its definition (autograd through torch ops).

    Gated: h = [gate | up] (or gate/up interleaved, gate first) of width 2F -> [S, F];
    non-gated: f(h). Kinds: "swiglu" (silu), "gelu" (exact), "gelu_tanh", "relu2"
    (relu(x)^2), "swiglu_clamp" (silu(min(gate, limit)) * clamp(up, -limit, limit)),
    "gpt_oss" (g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate,
    limit)); any other kind is the elementwise function `fn`.
    """
    if gated:
        if interleaved:
            gate, up = h_SN[..., 0::2], h_SN[..., 1::2]
        else:
            gate, up = h_SN.chunk(2, dim=-1)
    else:
        gate, up = h_SN, None
    if kind == "gpt_oss":
        g = gate.clamp(max=limit)
        return g * torch.sigmoid(g * alpha) * (up.clamp(-limit, limit) + 1)
    if kind == "swiglu_clamp":
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    elementwise = {
        "swiglu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "relu2": lambda x: F.relu(x).square(),
    }
    f = elementwise[kind](gate) if kind in elementwise else fn(gate)
    return f if up is None else f * up


def swiglu_reference(
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None = None,
    activation: ActivationConfig | str | None = None,
):
    """act(gate, up) (* prob) per row; gate = columns [0, F) and up = [F, 2F), or the
    even and odd columns when `activation.interleaved`; act(h) when not gated. The
    kinds are those of `activation_reference`.
    """
    act = as_activation(activation)
    if act.kind not in ("swiglu", "gpt_oss") or not act.gated:
        from .eager import REGISTERED  # elementwise functions given by the caller

        out = activation_reference(
            h_S2F,
            act.kind,
            gated=act.gated,
            interleaved=act.interleaved,
            alpha=act.alpha,
            limit=act.limit,
            fn=REGISTERED.get(act.kind),
        )
    else:
        out = activation_reference(
            h_S2F, act.kind, interleaved=act.interleaved, alpha=act.alpha, limit=act.limit
        )
    if prob_S is not None:
        out = out * prob_S.unsqueeze(-1).to(out.dtype)
    return out
