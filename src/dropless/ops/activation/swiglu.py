"""The expert activation op: act(gate, up) x prob with autograd (`expert_activation`,
also under its historical name `swiglu`), and its autograd Function.

Saves only the gate/up input and the prob (the output is recomputed in backward), so
the activation costs no extra memory beyond the GEMM output it consumes.

The activation is described by an `ActivationConfig` (see `specs.py`); its math lives in
`eager.py`. For the kinds the row ops compute ("swiglu", "gpt_oss", gated) one
autograd Function (`_Activation`) takes its forward/backward implementation from the
row-op registry (`permute/row_ops.py`): the eager fp32 forms or a registered kernel (Triton on
CUDA); other kinds run `eager.ElementwiseAct`.
"""

# S rows (sorted pairs), F expert hidden dim

from __future__ import annotations

import torch

from ..permute.row_ops import pick_row_ops
from ..specs import ActivationConfig, as_activation
from .eager import ACTIVATIONS, GPT_OSS, ElementwiseAct, check_supported

__all__ = ["ACTIVATIONS", "activation", "check_supported", "expert_activation", "swiglu"]


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
    alpha: float = GPT_OSS.alpha,
    limit: float = GPT_OSS.limit,
) -> torch.Tensor:
    """`swiglu` computed by a given `RowOps` implementation (no picking, no checks)."""
    return _Activation.apply(h_S2F, prob_S, interleaved, activation, alpha, limit, impl)


def expert_activation(
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
    where available, else the eager fp32 math of `activations`).
    """
    act = check_supported(
        as_activation(activation, interleaved=interleaved, alpha=alpha, limit=limit)
    )
    if h_S2F.dim() != 2 or (act.gated and h_S2F.shape[-1] % 2):
        raise ValueError(f"h must be [S, 2F] (gated) or [S, F], got shape {tuple(h_S2F.shape)}")
    if prob_S is not None and prob_S.shape != (h_S2F.shape[0],):
        raise ValueError(f"prob_S must be [S]={h_S2F.shape[0]}, got {tuple(prob_S.shape)}")
    if act.kind not in ACTIVATIONS or not act.gated:
        return ElementwiseAct.apply(h_S2F, prob_S, act)
    impl = pick_row_ops(h_S2F, activation=act.kind)
    return _Activation.apply(h_S2F, prob_S, act.interleaved, act.kind, act.alpha, act.limit, impl)


#: the historical name of `expert_activation` (it computes every kind, not only SwiGLU)
swiglu = expert_activation
