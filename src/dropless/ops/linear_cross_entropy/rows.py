"""Registry of the cross-entropy row op: the loss of a chunk of logits and, in place, its gradient.

The fused linear cross-entropy (`eager.py`, backend "fused") computes one
chunk of logits at a time and hands it to a `CERows` implementation, which returns the
per-row loss and, asked for the gradient, overwrites the logits with

    g[r, v] = scale[r] * (softmax(x[r])[v] - (1 - s) * [v == label[r]] - s / V)

(s the label smoothing; rows whose label is `ignore_index` get loss 0 and gradient 0).
"eager" (torch ops; every device and dtype, the implementation CPU runs) is always
registered; `gpu.py` registers "triton" (one kernel pass per row block, CUDA
tensors only) on the first pick for a CUDA tensor. Picking never chooses an
implementation that cannot run the tensor.
"""

# C rows of the chunk (tokens), V vocabulary

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import Registry


@dataclass(frozen=True)
class CERows:
    """One implementation of the row op (raw: no autograd).

    run(logits_CV, labels_C, scale_C, *, ignore_index, smoothing, grad) -> loss_C:
    logits_CV a contiguous chunk (any float dtype), labels_C int64, scale_C the per-row
    factor of the gradient (fp32, fp64 for fp64 logits); the loss is in that dtype.
    With grad=True the logits are overwritten by the gradient (module docstring), in
    their own dtype. supports(t): whether it runs the logits tensor t.
    """

    name: str
    run: Callable
    supports: Callable[[torch.Tensor], bool]
    priority: int = 0


CE_ROWS = Registry("cross-entropy rows")


def register_ce_rows(impl: CERows) -> None:
    """Register (or replace) a row-op implementation under its name."""
    CE_ROWS.register(impl)


def ce_rows_names() -> list[str]:
    """Registered implementations, best first."""
    return CE_ROWS.names()


def ce_rows(
    logits_CV: torch.Tensor,
    labels_C: torch.Tensor,
    scale_C: torch.Tensor,
    *,
    ignore_index: int,
    smoothing: float,
    grad: bool,
    impl: CERows | None = None,
) -> torch.Tensor:
    """The row op on one chunk (`CERows.run`'s arguments) by `impl`, or else by the best
    registered implementation that runs these logits."""
    impl = impl or CE_ROWS.pick(None, logits_CV) or EAGER_CE_ROWS
    return impl.run(
        logits_CV, labels_C, scale_C, ignore_index=ignore_index, smoothing=smoothing, grad=grad
    )


def ce_rows_eager(
    logits_CV: torch.Tensor,
    labels_C: torch.Tensor,
    scale_C: torch.Tensor,
    *,
    ignore_index: int,
    smoothing: float,
    grad: bool,
) -> torch.Tensor:
    """The row op in torch ops: three passes over the chunk with a gradient (an in-place
    log-softmax, whose row statistics stay in cache, then log-scale and exp), one without;
    label smoothing adds two (the row means, the uniform term).
    16-bit logits are worked on in an fp32 copy, as `logits.float()` then cross-entropy
    does, and the gradient is rounded once into them."""
    acc = scale_C.dtype
    x = logits_CV if logits_CV.dtype == acc else logits_CV.to(acc)
    valid_C = labels_C != ignore_index
    safe_C1 = torch.where(valid_C, labels_C, 0).unsqueeze(1)
    # log p in place: loss and gradient both come from it, and it is exact where a
    # softmax would underflow (-log of a 0 probability)
    torch.log_softmax(x, 1, out=x)
    loss_C = x.gather(1, safe_C1).squeeze(1).neg_()
    if smoothing:
        loss_C = loss_C.mul_(1.0 - smoothing).sub_(x.mean(1), alpha=smoothing)
    loss_C = torch.where(valid_C, loss_C, 0)
    if not grad:
        return loss_C
    scale_C = torch.where(valid_C, scale_C, 0)
    # exp(log p + log scale) = scale * softmax in one pass more; log 0 = -inf gives the
    # ignored rows exact zeros
    x.add_(scale_C.log().unsqueeze(1)).exp_()
    x.scatter_add_(1, safe_C1, scale_C.mul(-(1.0 - smoothing)).unsqueeze(1))
    if smoothing:
        x.sub_(scale_C.mul(smoothing / x.shape[1]).unsqueeze(1))
    if x is not logits_CV:
        logits_CV.copy_(x)
    return loss_C


EAGER_CE_ROWS = CERows("eager", ce_rows_eager, supports=lambda t: True, priority=0)
register_ce_rows(EAGER_CE_ROWS)
