"""SwiGLU with the routing weight folded in: silu(gate) * up * prob, and its backward.

Saves only the gate/up input and the prob (the output is recomputed in backward), so
the activation costs no extra memory beyond the GEMM output it consumes.

The activation is described by an `ActivationConfig` (see `specs.py`): kind "swiglu"
(gate = columns [0, F), up = [F, 2F)) or "gpt_oss" (gate clamped above at `limit`, up
clamped to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)), optionally with
gate/up interleaved (gate = even columns, up = odd columns).
"""

# S rows (sorted pairs), F expert hidden dim

from __future__ import annotations

import torch

from .specs import ActivationConfig, as_activation


def _split(h_S2F: torch.Tensor, interleaved: bool):
    if interleaved:
        return h_S2F[:, 0::2], h_S2F[:, 1::2]
    F = h_S2F.shape[-1] // 2
    return h_S2F[:, :F], h_S2F[:, F:]


def _gpt_oss(gate, up, alpha, limit):
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_S2F, prob_S, interleaved):
        gate, up = _split(h_S2F, interleaved)
        out = torch.nn.functional.silu(gate) * up
        if prob_S is not None:
            out *= prob_S.unsqueeze(1).to(out.dtype)
        ctx.save_for_backward(h_S2F, prob_S)
        ctx.interleaved = interleaved
        return out

    @staticmethod
    def backward(ctx, g_SF):
        h_S2F, prob_S = ctx.saved_tensors
        gate, up = _split(h_S2F, ctx.interleaved)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_prob = None
        if prob_S is not None:
            if ctx.needs_input_grad[1]:
                grad_prob = (g_SF * silu * up).sum(-1).to(prob_S.dtype)
            g_SF = g_SF * prob_S.unsqueeze(1).to(g_SF.dtype)
        d_gate = g_SF * up * (sig * (1 + gate * (1 - sig)))
        d_up = g_SF * silu
        if ctx.interleaved:
            grad_h = torch.stack([d_gate, d_up], dim=-1).view_as(h_S2F)
        else:
            grad_h = torch.cat([d_gate, d_up], dim=-1)
        return grad_h, grad_prob, None


class _GptOssGLU(torch.autograd.Function):
    """Recomputes the clamped GLU under autograd in backward: saves only h and prob."""

    @staticmethod
    def forward(ctx, h_S2F, prob_S, interleaved, alpha, limit):
        gate, up = _split(h_S2F, interleaved)
        out = _gpt_oss(gate, up, alpha, limit)
        if prob_S is not None:
            out = out * prob_S.unsqueeze(1).to(out.dtype)
        ctx.save_for_backward(h_S2F, prob_S)
        ctx.args = (interleaved, alpha, limit)
        return out

    @staticmethod
    def backward(ctx, g_SF):
        h_S2F, prob_S = ctx.saved_tensors
        interleaved, alpha, limit = ctx.args
        with torch.enable_grad():
            h = h_S2F.detach().requires_grad_(True)
            p = None if prob_S is None else prob_S.detach().requires_grad_(ctx.needs_input_grad[1])
            gate, up = _split(h, interleaved)
            out = _gpt_oss(gate, up, alpha, limit)
            if p is not None:
                out = out * p.unsqueeze(1).to(out.dtype)
            inputs = [h] + ([p] if p is not None and p.requires_grad else [])
            grads = torch.autograd.grad(out, inputs, g_SF)
        grad_prob = grads[1] if len(grads) > 1 else None
        return grads[0], grad_prob, None, None, None


def check_supported(act: ActivationConfig) -> ActivationConfig:
    """Raise ValueError for an activation these ops do not compute."""
    from .activations import is_elementwise_kind

    if act.kind in ("gpt_oss", "swiglu_clamp") and not act.gated:
        raise ValueError(f"activation.kind={act.kind!r} needs gated=True (it uses gate and up)")
    if act.kind != "gpt_oss" and not is_elementwise_kind(act.kind):
        raise ValueError(
            f"activation.kind={act.kind!r} has no implementation in dropless.ops; register "
            "an elementwise function with dropless.ops.activations.register_elementwise"
        )
    return act


def swiglu(
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None = None,
    *,
    activation: ActivationConfig | str | None = None,
    interleaved: bool | None = None,
    alpha: float | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    """act(gate, up) * prob for each row, act given by `activation` (an ActivationConfig,
    default swiglu). A kind name with `interleaved`, `alpha`, `limit` keywords is the
    same description in keyword form."""
    act = check_supported(
        as_activation(activation, interleaved=interleaved, alpha=alpha, limit=limit)
    )
    if h_S2F.dim() != 2 or (act.gated and h_S2F.shape[-1] % 2):
        raise ValueError(f"h must be [S, 2F] (gated) or [S, F], got shape {tuple(h_S2F.shape)}")
    if act.kind not in ("swiglu", "gpt_oss") or not act.gated:
        from .activations import ElementwiseAct

        return ElementwiseAct.apply(h_S2F, prob_S, act.kind, act.gated, act.interleaved, act.limit)
    if act.kind == "swiglu":
        return _SwiGLU.apply(h_S2F, prob_S, act.interleaved)
    return _GptOssGLU.apply(h_S2F, prob_S, act.interleaved, act.alpha, act.limit)
