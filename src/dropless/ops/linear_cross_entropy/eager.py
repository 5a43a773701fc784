"""Linear layer + cross-entropy without the full `[T, V]` logits.

`linear_cross_entropy(h, w, labels)` equals `F.cross_entropy(F.linear(h, w, b).float(), labels)`
(the loss of a language-model head), through one of the entries of the registry
`CE_BACKENDS`:

"fused" (the one entry today; reductions "mean" and "sum"): the gradients are computed
in the forward, chunk by chunk of tokens into one reused `[C, V]` logits buffer in the
input dtype (`fused_pass.py`, its row op `rows.py`), so the backward only scales them by
the incoming gradient (no logits recomputed: three GEMMs per chunk, not four), in place:
a second backward through the same graph raises. Kept from forward to backward:
O(T*D + V*D), never O(T*V). The logits are rounded where a stock head rounds them (in the
input dtype, then fp32). A named entry that cannot run the call raises ValueError with
its reason; it never falls back. Chunk sizes, buffers and their memory: docs/genomics.md,
"Fused linear + cross-entropy". A loss on logits a caller already has:
`rows.cross_entropy`.
"""

# T tokens, D hidden (in features), V vocabulary (classes), C tokens in one chunk

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compute_dtype import autocast_dtype
from ..registry import Registry
from . import custom_op
from .fused_pass import fused_pass
from .rows import CERows

REDUCTIONS = ("mean", "sum")
_MIN_CHUNK = 128
# "fused": one chunk's logits at most this large, and 2,048 rows at most. Each chunk
# costs one read-modify-write of the [V, D] fp32 weight gradient, so chunks are large;
# a larger one adds its whole buffer to the step's peak memory (it is live at the end of
# the forward, beside every activation)
LOGITS_BUFFER_BYTES = 1 << 30
_MAX_FUSED_CHUNK = 2048


def fused_chunk_size(num_tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk of the "fused" backend: as many as fit `LOGITS_BUFFER_BYTES` of
    logits in `dtype`, a multiple of 128, between 128 and 2,048 (and at most the tokens)."""
    fit = LOGITS_BUFFER_BYTES // max(vocab * dtype.itemsize, 1)
    rows = max(_MIN_CHUNK, min(_MAX_FUSED_CHUNK, fit // _MIN_CHUNK * _MIN_CHUNK))
    return max(1, min(num_tokens, rows))


def linear_cross_entropy(
    h: torch.Tensor,
    weight_VD: torch.Tensor,
    labels: torch.Tensor,
    bias_V: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of `h @ weight^T (+ bias)` against `labels`, chunked over tokens.

    h is [..., D], labels the matching [...] int64 class ids (`ignore_index` marks
    positions that count for nothing). Same value and gradients as
    `F.cross_entropy(F.linear(h, weight, bias).float(), labels, ...)`, including a
    NaN mean (and zero gradients) when every label is ignored. Returns a scalar (fp32,
    or fp64 for fp64 inputs).
    """
    _check_args(h, weight_VD, labels, bias_V, label_smoothing, reduction, chunk_size)
    entry = _pick(backend, h, reduction, label_smoothing)
    h_TD = h.reshape(-1, h.shape[-1])
    labels_T = labels.reshape(-1)
    return entry.run(
        h_TD, weight_VD, labels_T, bias_V, ignore_index, label_smoothing, reduction, chunk_size
    )


@dataclass(frozen=True)
class CEBackend:
    """One way to compute `linear_cross_entropy`: run(h_TD, weight_VD, labels_T, bias_V,
    ignore_index, label_smoothing, reduction, chunk_size) -> loss; refuses(h, reduction,
    label_smoothing): why it cannot run the call ("" when it can); auto(h, reduction,
    label_smoothing): whether "auto" takes it for the call (among those that can run it,
    by priority)."""

    name: str
    run: Callable
    refuses: Callable[..., str]
    auto: Callable[..., bool]
    priority: int = 0


CE_BACKENDS = Registry("linear cross-entropy backend")


def _pick(backend: str, h, reduction: str, label_smoothing: float) -> CEBackend:
    call = (h, reduction, label_smoothing)
    entry = CE_BACKENDS.entries.get(backend)
    detail = f": {entry.refuses(*call)}" if entry is not None else ""
    if backend in (None, "auto"):
        return CE_BACKENDS.pick(None, h, runs=lambda e: not e.refuses(*call) and e.auto(*call))
    return CE_BACKENDS.pick(backend, h, runs=lambda e: not e.refuses(*call), detail=detail)


def _check_args(h, weight_VD, labels, bias_V, label_smoothing, reduction, chunk_size):
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: expected a float in [0, 1]")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: expected a positive int or None")
    if weight_VD.dim() != 2 or h.shape[-1] != weight_VD.shape[1]:
        raise ValueError(
            f"weight must be [V, D] with D = h.shape[-1]; got h {tuple(h.shape)}, "
            f"weight {tuple(weight_VD.shape)}"
        )
    if bias_V is not None and tuple(bias_V.shape) != (weight_VD.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight_VD.shape[0]}]; got {tuple(bias_V.shape)}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64 class ids; got {labels.dtype}")
    if tuple(labels.shape) != tuple(h.shape[:-1]):
        raise ValueError(
            f"labels {tuple(labels.shape)} must match h without its last dim {tuple(h.shape[:-1])}"
        )


def fused_linear_cross_entropy(
    h_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    bias_V: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    rows: CERows | None = None,
) -> torch.Tensor:
    """The "fused" backend on 2-D `h_TD` (module docstring); reduction "mean" or "sum".

    rows: the row-op implementation (default: the best registered one that runs the
    logits chunk; tests pass the Triton kernel to run it on CPU under the interpreter).
    Outside of autograd (no grad mode, or no input requiring a gradient) only the loss
    is computed. Under autocast the GEMMs run in the autocast dtype, as `F.linear` would.
    Under `torch.compile` / `torch.export` (rows None) the pass is one
    `dropless::linear_cross_entropy` node (`custom_op.py`).
    """
    assert reduction in ("mean", "sum"), reduction
    h_TD, weight_VD, bias_V = _autocast_inputs(h_TD, weight_VD, bias_V)
    T = h_TD.shape[0]
    chunk = chunk_size or fused_chunk_size(T, weight_VD.shape[0], h_TD.dtype)
    args = (ignore_index, float(label_smoothing), reduction, chunk, rows)
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and t is not None and t.requires_grad for t in (h_TD, weight_VD, bias_V))
    # the inputs are cast already; the out= GEMMs and the row op run in their dtypes
    with torch.autocast(h_TD.device.type, enabled=False):
        if rows is None and torch.compiler.is_compiling():  # one node (custom_op.py)
            return custom_op.run(h_TD, weight_VD, bias_V, labels_T, args[:4], needs)
        if not any(needs):
            return fused_pass(h_TD, weight_VD, bias_V, labels_T, args, needs)[0]
        return _FusedLinearCE.apply(h_TD, weight_VD, bias_V, labels_T, args, needs)


def _autocast_inputs(h_TD, weight_VD, bias_V):
    """The inputs as `F.linear` under the active autocast sees them: fp32 tensors in the
    autocast dtype (cast outside the autograd Function, so their gradients flow back
    through the casts in fp32, as stock's do)."""
    dtype = autocast_dtype(h_TD, weight_VD, bias_V)  # the expert path's rule (fp64 stays)
    if dtype is None:
        return h_TD, weight_VD, bias_V

    def cast(t):
        return t.to(dtype) if t is not None and t.dtype == torch.float32 else t

    return cast(h_TD), cast(weight_VD), cast(bias_V)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, weight_VD, bias_V, labels_T, args, needs):
        loss, grads = fused_pass(h_TD, weight_VD, bias_V, labels_T, args, needs)
        # saved as tensors (not ctx attributes) so saved-tensor hooks see and can offload them
        ctx.save_for_backward(*(g for g in grads if g is not None))
        ctx.layout = tuple(g is not None for g in grads)
        ctx.dtypes = (h_TD.dtype, weight_VD.dtype, None if bias_V is None else bias_V.dtype)
        ctx.used = False
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable  # the saved gradients are constants
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError(
                "linear_cross_entropy(backend='fused') scales its forward-computed gradients "
                "in place, so its graph cannot be run backward twice (retain_graph=True); "
                "compute the loss again for a second backward"
            )
        ctx.used = True
        saved = iter(ctx.saved_tensors)
        out = []
        for present, dtype in zip(ctx.layout, ctx.dtypes):
            g = next(saved) if present else None
            # in place: the buffers are this backward's own (fp32 for 16-bit inputs)
            out.append(None if g is None else g.mul_(grad_out.to(g.dtype)).to(dtype))
        return out[0], out[1], out[2], None, None, None


def _run_fused(h_TD, weight_VD, labels_T, bias_V, ignore_index, smoothing, reduction, chunk_size):
    return fused_linear_cross_entropy(
        h_TD, weight_VD, labels_T, bias_V, ignore_index=ignore_index,
        label_smoothing=smoothing, reduction=reduction, chunk_size=chunk_size,
    )  # fmt: skip


CE_BACKENDS.register(
    CEBackend("fused", _run_fused, lambda *call: "", lambda *call: True, priority=30)
)
