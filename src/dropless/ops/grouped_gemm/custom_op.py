"""The grouped GEMM as PyTorch custom ops (`dropless::grouped_gemm` and its backward): what
`torch.compile` and `torch.export` see of `grouped_gemm` when the group sizes come as a
tensor. The node reads the counts when it runs, so a compiled graph neither breaks at
`counts.tolist()` nor specialises on the group sizes; it calls the eager Function's
forward and backward, so the math is that one's.
"""

# S rows, D in features, N out features, E groups

from __future__ import annotations

import torch
from torch import Tensor

from .eager import bound_backend, check_counts, gemm_backward, gemm_forward


def _out_features(w: Tensor, trans_w: bool) -> int:
    return w.shape[1] if trans_w else w.shape[2]


@torch.library.custom_op("dropless::grouped_gemm", mutates_args=())
def grouped_gemm_op(
    x_SD: Tensor, w: Tensor, bias_EN: Tensor | None, counts_E: Tensor, trans_w: bool
) -> Tensor:
    """y[s] = x[s] @ w[e(s)]^T (+ bias[e(s)]) over groups of `counts_E` rows."""
    counts = check_counts(x_SD, w, counts_E)
    return gemm_forward(x_SD, w, bias_EN, counts, None, trans_w, None)[0]


@grouped_gemm_op.register_fake
def _(x_SD, w, bias_EN, counts_E, trans_w):
    return x_SD.new_empty(x_SD.shape[0], _out_features(w, trans_w))


@torch.library.custom_op("dropless::grouped_gemm_backward", mutates_args=())
def grouped_gemm_backward_op(
    grad_SN: Tensor, x_SD: Tensor, w: Tensor, counts_E: Tensor, trans_w: bool, needs: list[bool]
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_w, grad_bias); an empty tensor where `needs` (same order) says none
    is wanted."""
    counts = [int(c) for c in counts_E.tolist()]
    bound = bound_backend(x_SD, w, counts, None, None)
    grads = gemm_backward(grad_SN, x_SD, w, bound, counts, trans_w, needs)
    return tuple(x_SD.new_empty(0) if g is None else g for g in grads)


@grouped_gemm_backward_op.register_fake
def _(grad_SN, x_SD, w, counts_E, trans_w, needs):
    bias_like = w.new_empty(w.shape[0], _out_features(w, trans_w))
    return tuple(
        torch.empty_like(t) if need else x_SD.new_empty(0)
        for t, need in zip((x_SD, w, bias_like), needs)
    )


def _setup_context(ctx, inputs, output):
    x_SD, w, bias_EN, counts_E, trans_w = inputs
    ctx.save_for_backward(x_SD, w, counts_E)
    ctx.trans_w, ctx.has_bias = trans_w, bias_EN is not None


def _backward(ctx, grad_SN):
    x_SD, w, counts_E = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [n[0], n[1], ctx.has_bias and n[2]]
    grads = grouped_gemm_backward_op(grad_SN.contiguous(), x_SD, w, counts_E, ctx.trans_w, needs)
    gx, gw, gb = (g if need else None for g, need in zip(grads, needs))
    return gx, gw, gb, None, None


torch.library.register_autograd("dropless::grouped_gemm", _backward, setup_context=_setup_context)


def run(x_SD: Tensor, w: Tensor, counts_E: Tensor, bias_EN: Tensor | None, trans_w: bool):
    """`grouped_gemm` through the custom op (under torch.autocast in its dtype, as the
    eager entry)."""
    from ..compute_dtype import autocast_dtype

    if counts_E.dim() != 1 or counts_E.dtype.is_floating_point or counts_E.numel() != w.shape[0]:
        raise ValueError(
            f"counts must be a 1-D integer tensor of {w.shape[0]} groups (the weight's), got "
            f"{counts_E.dtype} of shape {tuple(counts_E.shape)}"
        )
    dt = autocast_dtype(x_SD, w, bias_EN)
    if dt is not None:
        x_SD, w = x_SD.to(dt), w.to(dt)
        bias_EN = None if bias_EN is None else bias_EN.to(dt)
    return grouped_gemm_op(x_SD, w, bias_EN, counts_E, bool(trans_w))
