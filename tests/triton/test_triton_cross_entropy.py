"""Triton cross-entropy row kernel: alone against the eager row op, and inside
linear_cross_entropy's "fused" backend against the reference (the head, then
F.cross_entropy), forward and backward, fp32.

`check(case, device)` runs under TRITON_INTERPRET=1 in a child process (tests/interpreted.py),
so nothing here imports triton at module level; on a CUDA machine the same checks also
run compiled (marker `gpu`).
"""

# T tokens, D hidden, V vocabulary, C rows of a chunk

from __future__ import annotations

import pytest
import torch

from interpreted import interpreted_tests

# name -> (T, D, V, chunk, fraction ignored, label smoothing, bias, reduction)
# interpreter tiles: 4 rows x 16 columns
CASES = {
    "multi_chunk": (37, 16, 50, 8, 0.3, 0.0, True, "mean"),  # T, V not tile multiples
    "sum_no_bias": (21, 8, 33, 16, 0.2, 0.0, False, "sum"),
    "T=1": (1, 8, 11, 4, 0.0, 0.0, True, "mean"),
    "all_ignored": (9, 8, 13, 4, 1.0, 0.0, True, "mean"),
    "all_ignored_sum": (6, 4, 9, 4, 1.0, 0.0, False, "sum"),
    "smoothing": (29, 12, 31, 8, 0.25, 0.1, True, "mean"),
    "smoothing=1": (10, 6, 17, 3, 0.2, 1.0, False, "sum"),
    "V_below_a_tile": (7, 4, 5, 7, 0.0, 0.0, True, "mean"),
}


def _inputs(T, D, V, ignored, bias, device, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.5
    b = torch.randn(V, generator=g) * 0.1 if bias else None
    y = torch.randint(0, V, (T,), generator=g)
    y[torch.rand(T, generator=g) < ignored] = -100
    leaves = [t.to(device).requires_grad_() for t in (h, w, b) if t is not None]
    return leaves, y.to(device)


def _check_rows(case, device):
    """The kernel alone: loss and in-place gradient equal the eager row op's."""
    from dropless.ops.linear_cross_entropy.cross_entropy_kernels import ce_rows
    from dropless.ops.linear_cross_entropy.rows import ce_rows_eager

    T, _, V, _, ignored, smoothing, _, _ = case
    g = torch.Generator().manual_seed(T * 7 + V)
    x = (torch.randn(T, V, generator=g) * 4).to(device)
    y = torch.randint(0, V, (T,), generator=g)
    y[torch.rand(T, generator=g) < ignored] = -100
    y, scale = y.to(device), torch.rand(T, generator=g).to(device)
    kw = dict(ignore_index=-100, smoothing=smoothing, grad=True)
    got, want = x.clone(), x.clone()
    loss = ce_rows(got, y, scale, **kw)
    loss_want = ce_rows_eager(want, y, scale, **kw)
    # fp32: an online max / sum-exp against torch's two-pass log-softmax
    torch.testing.assert_close(loss, loss_want, rtol=1e-5, atol=1e-5, msg="row loss")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg="row gradient")


def check(case, device: str) -> None:
    from dropless.ops.linear_cross_entropy import fused_linear_cross_entropy
    from dropless.ops.linear_cross_entropy.cross_entropy_kernels import ce_rows
    from dropless.ops.linear_cross_entropy.rows import CERows
    from dropless.ops.reference import linear_cross_entropy_reference as reference

    _check_rows(case, device)
    T, D, V, chunk, ignored, smoothing, bias, reduction = case
    kernel = CERows("triton-under-test", ce_rows, supports=lambda t: True)
    kw = dict(label_smoothing=smoothing, reduction=reduction)
    results = []
    for run in (
        lambda p, y: fused_linear_cross_entropy(
            p[0], p[1], y, *p[2:], rows=kernel, chunk_size=chunk, **kw
        ),
        lambda p, y: reference(p[0], p[1], y, *p[2:], **kw),
    ):
        leaves, y = _inputs(T, D, V, ignored, bias, device, seed=T + V)
        loss = run(leaves, y)
        results.append([loss, *torch.autograd.grad(loss * 1.7, leaves)])
    for name, a, b in zip(["loss", "dh", "dw", "db"], *results):
        tol = dict(rtol=1e-5, atol=1e-5 if name == "loss" else 1e-6)
        torch.testing.assert_close(a, b, **tol, equal_nan=True, msg=name)
    if ignored == 1.0:
        assert all((g == 0).all() for g in results[0][1:])


test_interpreted, test_cuda = interpreted_tests(CASES, check)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_head_matches_the_stock_head():
    """bf16 on CUDA, as a training step runs it (auto: the Triton row op, 16-bit GEMMs
    with fp32 outputs into the gradient buffers): within bf16 rounding of the stock head."""
    from dropless.ops import linear_cross_entropy
    from dropless.ops.reference import linear_cross_entropy_reference

    g = torch.Generator().manual_seed(0)
    T, D, V = 1000, 256, 3001
    base = [torch.randn(T, D, generator=g), torch.randn(V, D, generator=g) * 0.05]
    y = torch.randint(0, V, (T,), generator=g)
    y[::7] = -100
    out = []
    for fn in (linear_cross_entropy, linear_cross_entropy_reference):
        leaves = [t.cuda().bfloat16().requires_grad_() for t in base]
        kw = dict(chunk_size=384) if fn is linear_cross_entropy else {}
        loss = fn(leaves[0], leaves[1], y.cuda(), **kw)
        out.append([loss, *torch.autograd.grad(loss * 0.5, leaves)])
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-4, atol=1e-4)
    for a, b in zip(out[0][1:], out[1][1:]):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
