"""The "fused" linear cross-entropy as a PyTorch custom op
(`dropless::linear_cross_entropy`): what `torch.compile` and `torch.export` see of
`linear_cross_entropy` with reduction "mean" or "sum".

The node runs the fused pass of eager code (`fused_pass.py`: chunked logits, the row
op picked when the node runs, so the Triton row kernel of a CUDA call registers and runs
even when the process's first call is compiled), returning the loss and the gradients of
h, w and b for an incoming gradient of 1 (empty where not wanted). Its registered
backward scales them by the incoming gradient: plain torch ops, which the compiler sees.
Dynamo never traces the per-chunk loop (one graph per chunk count otherwise).
"""

# T tokens, D hidden, V vocabulary

from __future__ import annotations

import torch
from torch import Tensor

from .fused_pass import fused_pass


def _acc(h: Tensor) -> torch.dtype:
    return torch.promote_types(h.dtype, torch.float32)


@torch.library.custom_op("dropless::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    h_TD: Tensor,
    weight_VD: Tensor,
    bias_V: Tensor | None,
    labels_T: Tensor,
    ignore_index: int,
    smoothing: float,
    reduction: str,
    chunk: int,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, grad_h, grad_w, grad_b) in the accumulation dtype (fp32, fp64 for fp64
    inputs) for an incoming gradient of 1; a gradient not in `needs` (h, w, b) is empty."""
    args = (ignore_index, smoothing, reduction, chunk, None)
    loss, grads = fused_pass(h_TD, weight_VD, bias_V, labels_T, args, tuple(needs))
    return (loss, *(h_TD.new_empty(0, dtype=_acc(h_TD)) if g is None else g for g in grads))


@linear_cross_entropy_op.register_fake
def _(h_TD, weight_VD, bias_V, labels_T, ignore_index, smoothing, reduction, chunk, needs):
    acc = _acc(h_TD)
    like = (h_TD, weight_VD, bias_V)
    grads = (
        torch.empty_like(t, dtype=acc) if need and t is not None else h_TD.new_empty(0, dtype=acc)
        for t, need in zip(like, needs)
    )
    return (h_TD.new_empty((), dtype=acc), *grads)


def _setup_context(ctx, inputs, output):
    h_TD, weight_VD, bias_V = inputs[:3]
    ctx.needs = inputs[-1]
    ctx.dtypes = (h_TD.dtype, weight_VD.dtype, None if bias_V is None else bias_V.dtype)
    ctx.save_for_backward(*output[1:])
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grad_loss, *_unused):
    grads = [
        g.mul(grad_loss.to(g.dtype)).to(dtype) if need else None
        for g, need, dtype in zip(ctx.saved_tensors, ctx.needs, ctx.dtypes)
    ]
    return (*grads, None, None, None, None, None, None)


torch.library.register_autograd(
    "dropless::linear_cross_entropy", _backward, setup_context=_setup_context
)


def run(h_TD, weight_VD, bias_V, labels_T, args, needs) -> Tensor:
    """The fused loss through the custom op (args: ignore_index, smoothing, reduction,
    chunk)."""
    ignore_index, smoothing, reduction, chunk = args
    loss, *_ = linear_cross_entropy_op(
        h_TD, weight_VD, bias_V, labels_T, int(ignore_index), float(smoothing), reduction,
        int(chunk), list(needs),
    )  # fmt: skip
    return loss
