"""The pass of the "fused" linear cross-entropy backend (`eager.py`'s module docstring
says how it works): the loss and, for an incoming gradient of 1, the gradients of h, w
and b, over chunks of tokens. Eager code runs it inside its autograd Function; a
compiled region runs it inside the `dropless::linear_cross_entropy` node
(`custom_op.py`)."""

# T tokens, D hidden, V vocabulary, C tokens in one chunk

from __future__ import annotations

import torch

from .rows import ce_rows


def fused_pass(h_TD, weight_VD, bias_V, labels_T, args, needs):
    """(loss, (grad_h, grad_w, grad_b)) for an incoming gradient of 1; the gradients
    are None where not needed."""
    ignore_index, smoothing, reduction, chunk, rows = args
    T, V = h_TD.shape[0], weight_VD.shape[0]
    dev, acc = h_TD.device, torch.promote_types(h_TD.dtype, torch.float32)
    need_h, need_w, need_b = needs
    grad = any(needs)
    valid_T = labels_T != ignore_index
    n_valid = valid_T.sum().to(acc)  # stays on the device: no host sync
    one = torch.ones((), dtype=acc, device=dev)
    scale_T = torch.where(valid_T, one / n_valid.clamp_min(1) if reduction == "mean" else one, 0)
    loss_T = torch.empty(T, dtype=acc, device=dev)
    grad_h = torch.empty(h_TD.shape, dtype=acc, device=dev) if need_h else None
    grad_w = torch.empty(weight_VD.shape, dtype=acc, device=dev) if need_w else None
    grad_b = torch.zeros(V, dtype=acc, device=dev) if need_b else None
    buf_CV = torch.empty(min(chunk, T), V, dtype=h_TD.dtype, device=dev)
    for s in range(0, T, chunk):
        h_CD = h_TD[s : s + chunk]
        x_CV = buf_CV[: h_CD.shape[0]]
        if bias_V is None:
            torch.mm(h_CD, weight_VD.t(), out=x_CV)
        else:
            torch.addmm(bias_V, h_CD, weight_VD.t(), out=x_CV)
        loss_T[s : s + chunk] = ce_rows(
            x_CV, labels_T[s : s + chunk], scale_T[s : s + chunk],
            ignore_index=ignore_index, smoothing=smoothing, grad=grad, impl=rows,
        )  # fmt: skip
        if need_b:
            grad_b.add_(x_CV.sum(0, dtype=acc))
        if need_h:
            mm_into(grad_h[s : s + chunk], x_CV, weight_VD, accumulate=False)
        if need_w:  # the first chunk writes the buffer, the others add to it
            mm_into(grad_w, x_CV.t(), h_CD, accumulate=s > 0)
    if need_w and T == 0:
        grad_w.zero_()
    total = loss_T.sum()
    loss = total / n_valid if reduction == "mean" else total  # 0 / 0: NaN, as stock
    return loss, (grad_h, grad_w, grad_b)


# whether this torch's CUDA addmm takes an fp32 `self`/`out` with 16-bit operands
# (`out_dtype=`; older releases require `self` in the operands' dtype): found on first use
_ADDMM_FP32_OUT: list[bool] = []


def mm_into(out, a, b, *, accumulate: bool):
    """out = a @ b (out += a @ b with accumulate), in out's dtype (fp32 for 16-bit a, b).

    16-bit operands on CUDA run the 16-bit GEMM writing fp32 into out (`out_dtype=`, in
    place: no weight-sized temporary; where torch's addmm refuses an fp32 `self`, the
    chunk's product goes through one fp32 temporary); on CPU they are upcast (16-bit
    matmul is slow there)."""
    if a.dtype == out.dtype:
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    if not a.is_cuda:
        a, b = a.to(out.dtype), b.to(out.dtype)
        return out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    if not accumulate:
        return torch.mm(a, b, out_dtype=out.dtype, out=out)
    if not _ADDMM_FP32_OUT or _ADDMM_FP32_OUT[0]:
        try:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            _ADDMM_FP32_OUT[:] = [True]
            return out
        except RuntimeError:
            _ADDMM_FP32_OUT[:] = [False]
    return out.add_(torch.mm(a, b, out_dtype=out.dtype))
