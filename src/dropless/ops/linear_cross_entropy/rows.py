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

`cross_entropy` is the row op as an autograd Function on logits a caller already has (a
Transformers model's, which it returns): it keeps only those logits for backward, whose
row op writes the gradient into one new buffer, or over the logits themselves when no
other tensor uses their memory any more (`_owns_memory`).
"""

# C rows of the chunk (tokens), V vocabulary, N rows of the logits

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..expert_mlp.engine import graph_released
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


# rows of one chunk of `cross_entropy`: this many bytes of fp32 logits (cache-sized)
_CHUNK_BYTES = 1 << 23


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, reduction="mean"
) -> torch.Tensor:
    """`F.cross_entropy(logits.reshape(-1, V).to(acc), labels.reshape(-1), ...)` for
    reduction "mean" or "sum", acc fp32 (fp64 for fp64 logits): the same loss and
    gradient (the logits' own dtype), a NaN mean when every label is ignored.

    Kept for backward: the logits (no log-probabilities). The backward writes the gradient
    of each chunk of rows with the row op, over a copy of the logits in one new buffer, or
    over the logits when no tensor but the saved one uses their memory, the graph is freed
    as it goes and no saved-tensor hook or tracing mode is active. Not twice
    differentiable."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: expected 'mean' or 'sum'")
    if labels.numel() * logits.shape[-1] != logits.numel():
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}")
    return _CrossEntropy.apply(logits, labels, int(ignore_index), reduction)


def _chunks(n: int, v: int):
    step = max(1, _CHUNK_BYTES // (4 * max(v, 1)))
    return ((s, min(s + step, n)) for s in range(0, n, step))


def _hooks_or_tracing() -> bool:
    """Saved-tensor hooks (they may hold what is saved) or a tracing mode (a traced
    in-place write would replay on logits a later caller holds)."""
    modes = torch._C._TorchDispatchModeKey
    return (
        torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        or torch._C._get_dispatch_mode(modes.PROXY) is not None
        or torch._C._get_dispatch_mode(modes.FUNCTIONAL) is not None
    )


def _use_count(t: torch.Tensor) -> int:
    storage = t.untyped_storage()  # held: the count includes it
    return torch._C._storage_Use_Count(storage._cdata)


def _owns_memory(x: torch.Tensor) -> bool:
    """Whether x, a saved tensor unpacked in backward, is the only tensor on its memory:
    the caller's logits are gone (they are another tensor on the same storage, saved as
    x = logits.detach()) and no other node saved them. The storage's count is torch's
    private one (pinned by tests/ops/test_linear_cross_entropy.py)."""
    return x.is_contiguous() and graph_released() and _use_count(x) == _use_count(x.new_empty(1))


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index, reduction):
        V = logits.shape[-1]
        x_NV, labels_N = logits.reshape(-1, V), labels.reshape(-1)
        acc = torch.promote_types(logits.dtype, torch.float32)
        n_valid = (labels_N != ignore_index).sum().to(acc)
        ones_N = torch.ones((), dtype=acc, device=logits.device).expand(labels_N.shape)
        loss_N = torch.empty(labels_N.shape, dtype=acc, device=logits.device)
        for s, e in _chunks(*x_NV.shape):  # the row op on a copy: it works in place
            loss_N[s:e] = ce_rows(
                x_NV[s:e].to(acc, copy=True), labels_N[s:e], ones_N[s:e],
                ignore_index=ignore_index, smoothing=0.0, grad=False,
            )  # fmt: skip
        # another tensor on the logits' memory: their owner's going shows in its count
        ctx.save_for_backward(logits.detach(), labels_N, n_valid)
        ctx.args = (ignore_index, reduction, _hooks_or_tracing())
        total = loss_N.sum()
        return total / n_valid if reduction == "mean" else total  # 0 / 0: NaN, as stock

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, labels_N, n_valid = ctx.saved_tensors
        ignore_index, reduction, hooked = ctx.args
        scale = grad_out.to(n_valid.dtype)
        scale_N = (scale / n_valid.clamp_min(1) if reduction == "mean" else scale).expand(
            labels_N.shape
        )
        own = not hooked and not _hooks_or_tracing() and _owns_memory(x)
        g = x if own else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        V = x.shape[-1]
        g_NV, x_NV = g.view(-1, V), x.reshape(-1, V)
        for s, e in _chunks(*g_NV.shape):
            if not own:
                g_NV[s:e].copy_(x_NV[s:e])
            ce_rows(
                g_NV[s:e], labels_N[s:e], scale_N[s:e],
                ignore_index=ignore_index, smoothing=0.0, grad=True,
            )  # fmt: skip
        return g, None, None, None
