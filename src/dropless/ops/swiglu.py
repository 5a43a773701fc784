"""SwiGLU with the routing weight folded in: silu(gate) * up * prob, and its backward.

Saves only the gate/up input and the prob (the output is recomputed in backward), so
the activation costs no extra memory beyond the GEMM output it consumes.

The activation is described by an `ActivationConfig` (see `specs.py`): kind "swiglu"
(gate = columns [0, F), up = [F, 2F)) or "gpt_oss" (gate clamped above at `limit`, up
clamped to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)), optionally with
gate/up interleaved (gate = even columns, up = odd columns).

One autograd Function (`_Activation`) takes its forward/backward implementation from
the row-op registry (`row_ops.py`): the eager functions below (the specification, math
in fp32, outputs rounded once to the input dtype) or a registered kernel (Triton on CUDA).
"""

# S rows (sorted pairs), F expert hidden dim

from __future__ import annotations

import torch

from .specs import ActivationConfig, as_activation

ACTIVATIONS = ("swiglu", "gpt_oss")  # the kinds the row ops compute
_GPT_OSS = ActivationConfig("gpt_oss")  # the alpha/limit defaults


def _split(h_S2F: torch.Tensor, interleaved: bool):
    if interleaved:
        return h_S2F[:, 0::2], h_S2F[:, 1::2]
    F = h_S2F.shape[-1] // 2
    return h_S2F[:, :F], h_S2F[:, F:]


def _parts(h_S2F, interleaved, activation, alpha, limit):
    """(act, up, d act/d gate, d act/d up) in fp32 (fp64 for fp64); act excludes the
    prob. For swiglu, `up` is returned and d act/d gate is given without its factor up:
    the formulas are written exactly as the quantized MLP's (`dropless.quant.mlp`), so
    both give the same bits before quantization."""
    acc = torch.promote_types(h_S2F.dtype, torch.float32)
    gate, up = (t.to(acc) for t in _split(h_S2F, interleaved))
    if activation == "swiglu":
        sig = torch.sigmoid(gate)
        act = torch.nn.functional.silu(gate) * up
        return act, up, sig * (1 + gate * (1 - sig)), gate * sig
    g = gate.clamp(max=limit)
    u1 = up.clamp(-limit, limit).add_(1)
    sig = torch.sigmoid(g * alpha)
    glu = g * sig
    # torch.clamp passes the gradient where min <= x <= max (inclusive)
    d_glu = (sig + alpha * glu * (1 - sig)).mul_(gate <= limit)
    return glu * u1, None, u1.mul_(d_glu), glu.mul_((up >= -limit) & (up <= limit))


def act_fwd_eager(
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None = None,
    interleaved: bool = False,
    activation: str = "swiglu",
    alpha: float = _GPT_OSS.alpha,
    limit: float = _GPT_OSS.limit,
) -> torch.Tensor:
    """act(gate, up) * prob (prob = 1 when None), fp32 math, in h's dtype; no autograd."""
    act = _parts(h_S2F, interleaved, activation, alpha, limit)[0]
    if prob_S is not None:
        act = act * prob_S.to(act.dtype).unsqueeze(1)
    return act.to(h_S2F.dtype)


def act_bwd_eager(
    grad_SF: torch.Tensor,
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None = None,
    interleaved: bool = False,
    need_prob_grad: bool = True,
    recompute: bool = False,
    activation: str = "swiglu",
    alpha: float = _GPT_OSS.alpha,
    limit: float = _GPT_OSS.limit,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward of `act_fwd_eager`: (grad_h, grad_prob or None, the forward output or None).

    grad_prob when prob_S is given and need_prob_grad; with recompute the forward output
    (act * prob, for the down projection's weight grad) comes back too. fp32 math.
    """
    act, up, d_gate, d_up = _parts(h_S2F, interleaved, activation, alpha, limit)
    g = grad_SF.to(act.dtype)
    grad_p = a = None
    if prob_S is not None:
        p = prob_S.to(act.dtype).unsqueeze(1)
        if need_prob_grad:
            gp = g * d_up * up if up is not None else g * act
            grad_p = gp.sum(1).to(prob_S.dtype)
        g = g * p
        if recompute:
            a = (act * p).to(h_S2F.dtype)
    elif recompute:
        a = act.to(h_S2F.dtype)
    grad_h = torch.empty_like(h_S2F)
    og, ou = _split(grad_h, interleaved)
    og.copy_(g * up * d_gate if up is not None else g * d_gate)
    ou.copy_(g * d_up)
    return grad_h, grad_p, a


class _Activation(torch.autograd.Function):
    """act(h) * prob with autograd; `impl` (a `RowOps`) supplies forward and backward."""

    @staticmethod
    def forward(ctx, h_S2F, prob_S, interleaved, activation, alpha, limit, impl):
        ctx.save_for_backward(h_S2F, prob_S)
        ctx.args, ctx.impl = (interleaved, activation, alpha, limit), impl
        return impl.act_fwd(h_S2F, prob_S, interleaved, activation, alpha, limit)

    @staticmethod
    def backward(ctx, g_SF):
        h_S2F, prob_S = ctx.saved_tensors
        interleaved, activation, alpha, limit = ctx.args
        need_gp = prob_S is not None and ctx.needs_input_grad[1]
        grad_h, grad_p, _ = ctx.impl.act_bwd(
            g_SF, h_S2F, prob_S, interleaved, need_gp, False, activation, alpha, limit
        )
        return grad_h, grad_p, None, None, None, None, None


def activation(
    h_S2F: torch.Tensor,
    prob_S: torch.Tensor | None,
    impl,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = _GPT_OSS.alpha,
    limit: float = _GPT_OSS.limit,
) -> torch.Tensor:
    """`swiglu` computed by a given `RowOps` implementation (no picking, no checks)."""
    return _Activation.apply(h_S2F, prob_S, interleaved, activation, alpha, limit, impl)


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
    same description in keyword form.

    Runs the best registered implementation for h's device (a Triton kernel on CUDA
    where available, else the eager fp32 math above).
    """
    from .row_ops import pick_row_ops

    act = check_supported(
        as_activation(activation, interleaved=interleaved, alpha=alpha, limit=limit)
    )
    if h_S2F.dim() != 2 or (act.gated and h_S2F.shape[-1] % 2):
        raise ValueError(f"h must be [S, 2F] (gated) or [S, F], got shape {tuple(h_S2F.shape)}")
    if prob_S is not None and prob_S.shape != (h_S2F.shape[0],):
        raise ValueError(f"prob_S must be [S]={h_S2F.shape[0]}, got {tuple(prob_S.shape)}")
    if act.kind not in ACTIVATIONS or not act.gated:
        from .activations import ElementwiseAct

        return ElementwiseAct.apply(h_S2F, prob_S, act.kind, act.gated, act.interleaved, act.limit)
    impl = pick_row_ops(h_S2F, activation=act.kind)
    return _Activation.apply(h_S2F, prob_S, act.interleaved, act.kind, act.alpha, act.limit, impl)
