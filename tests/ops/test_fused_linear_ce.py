"""linear_cross_entropy backend "fused" (gradients in the forward) against the reference
(the head, then F.cross_entropy): loss and gradients of h, weight and bias, edge cases, the state kept between
forward and backward (O(T*D + V*D), never O(T*V)), no host syncs, bad calls."""

# T tokens, D hidden, V vocabulary

import pytest
import torch
from sync_counter import count_syncs
from test_linear_cross_entropy import _inputs

from dropless.ops import linear_cross_entropy
from dropless.ops import reference as ref
from dropless.ops.linear_cross_entropy import LOGITS_BUFFER_BYTES, fused_chunk_size
from dropless.ops.linear_cross_entropy.rows import ce_rows_eager

CASES = {
    # name: (T, D, V, chunk, fraction of labels ignored, label smoothing)
    "multi_chunk": (37, 16, 50, 8, 0.3, 0.0),  # T not a multiple of the chunk, V not a power of 2
    "one_chunk_V_odd": (12, 8, 23, None, 0.0, 0.0),
    "T=1": (1, 8, 11, 4, 0.0, 0.0),
    "all_ignored": (9, 8, 13, 4, 1.0, 0.0),
    "chunk=1": (5, 4, 7, 1, 0.2, 0.0),
    "smoothing": (29, 12, 31, 8, 0.25, 0.1),
    "smoothing=1": (10, 6, 17, 3, 0.2, 1.0),
    "no_tokens": (0, 4, 7, None, 0.0, 0.0),
}


def _loss_and_grads(fn, h, w, b, y, upstream=1.7):
    loss = fn(h, w, y, b)
    params = [t for t in (h, w, b) if t is not None]
    return loss, torch.autograd.grad(loss * upstream, params)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_the_reference_fp32(case, reduction, bias):
    T, D, V, chunk, ignored, smoothing = CASES[case]
    h, w, b, y = _inputs(T, D, V, ignored, torch.float32, bias=bias)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    l0, g0 = _loss_and_grads(lambda *a: ref.linear_cross_entropy_reference(*a, **kw), h, w, b, y)
    l1, g1 = _loss_and_grads(
        lambda *a: linear_cross_entropy(*a, backend="fused", chunk_size=chunk, **kw), h, w, b, y
    )
    # fp32, the same math in another order (per-row log-softmax, one sum over rows)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5, equal_nan=True)
    for a, c in zip(g1, g0):
        assert a.dtype == torch.float32 and torch.isfinite(a).all() and a.shape == c.shape
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    if case in ("all_ignored", "no_tokens"):
        assert all((g == 0).all() for g in g1)
        assert torch.isnan(l1) if reduction == "mean" else l1 == 0


@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_fused_matches_the_reference_fp64(smoothing):
    """fp64 (not gradcheck: it runs backward twice, which "fused" refuses): equal to the
    reference to fp64 rounding."""
    h, w, b, y = _inputs(7, 4, 9, 0.3, torch.float64, seed=5)
    kw = dict(label_smoothing=smoothing)
    l0, g0 = _loss_and_grads(lambda *a: ref.linear_cross_entropy_reference(*a, **kw), h, w, b, y)
    l1, g1 = _loss_and_grads(
        lambda *a: linear_cross_entropy(*a, chunk_size=3, backend="fused", **kw), h, w, b, y
    )
    assert l1.dtype == torch.float64
    torch.testing.assert_close(l1, l0, rtol=1e-12, atol=1e-12)
    for a, c in zip(g1, g0):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_matches_the_stock_head_and_auto_takes_it(reduction):
    """auto takes "fused" for mean and sum: batched shapes, against F.cross_entropy on
    F.linear (the specification), also when only the weight needs a gradient."""
    h, w, b, y = _inputs(24, 8, 17, 0.2, torch.float32)
    y3 = y.reshape(2, 12)

    def ours(h, w, y, b):
        return linear_cross_entropy(h.reshape(2, 12, 8), w, y3, b, reduction=reduction)

    def stock(h, w, y, b):
        return ref.linear_cross_entropy_reference(h, w, y, b, reduction=reduction)

    l0, g0 = _loss_and_grads(stock, h, w, b, y)
    l1, g1 = _loss_and_grads(ours, h, w, b, y)
    assert type(ours(h, w, y, b).grad_fn).__name__ == "_FusedLinearCEBackward"
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    for a, c in zip(g1, g0):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    (gw,) = torch.autograd.grad(ours(h.detach(), w, y, None), [w])
    (gw0,) = torch.autograd.grad(stock(h.detach(), w, y, None), [w])
    torch.testing.assert_close(gw, gw0, rtol=1e-5, atol=1e-6)


def test_fused_without_grad_computes_only_the_loss():
    h, w, b, y = _inputs(37, 16, 50, 0.3, torch.float32)
    want = ref.linear_cross_entropy_reference(h, w, y, b)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y, b, chunk_size=8, backend="fused")
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    detached = [t.detach() for t in (h, w, b)]
    loss = linear_cross_entropy(*detached[:2], y, detached[2], chunk_size=8, backend="fused")
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)


def test_fused_keeps_O_TD_plus_VD_between_forward_and_backward():
    """The bytes saved for backward are the gradients of h, W and b (the forward computed
    them), nothing of T*V size: a chunk's logits are freed with the forward."""
    T, D, V = 256, 8, 512
    h, w, b, y = _inputs(T, D, V, 0.1, torch.float32)
    saved = []  # (bytes, data_ptr): holding the tensors here would stop autograd reusing them

    def pack(t):
        saved.append((t.numel() * t.element_size(), t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = linear_cross_entropy(h, w, y, b, chunk_size=64, backend="fused")
    assert sum(n for n, _ in saved) == 4 * (T * D + V * D + V)  # the three fp32 gradients
    assert max(n for n, _ in saved) < 4 * T * V // 16
    loss.backward()
    # fp32 inputs: the buffers, scaled in place, become the .grad tensors (no copy)
    assert {t.grad.data_ptr() for t in (h, w, b)} == {p for _, p in saved}


def test_fused_second_backward_is_refused():
    h, w, b, y = _inputs(9, 4, 7, 0.0, torch.float32)
    loss = linear_cross_entropy(h, w, y, b, backend="fused")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward twice"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_makes_no_host_sync(dtype):
    h, w, b, y = _inputs(37, 16, 50, 0.3, dtype)
    with count_syncs() as found:
        linear_cross_entropy(h, w, y, b, chunk_size=8, backend="fused").backward()
    assert found == [] and torch.isfinite(w.grad.float()).all()


def test_fused_bf16_rounds_like_the_stock_head():
    """bf16: the logits chunk is bf16 (as the stock head's output), the row op runs in
    fp32 on it, so the loss is the stock one to fp32 rounding; gradients in bf16."""
    h, w, b, y = _inputs(37, 16, 50, 0.25, torch.bfloat16)
    l0, g0 = _loss_and_grads(ref.linear_cross_entropy_reference, h, w, b, y)
    l1, g1 = _loss_and_grads(
        lambda *a: linear_cross_entropy(*a, chunk_size=8, backend="fused"), h, w, b, y
    )
    assert l1.dtype == torch.float32 and [g.dtype for g in g1] == [torch.bfloat16] * 3
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    for a, c in zip(g1, g0):
        # one bf16 ulp of the O(1e-2) entries: fp32 sums in another order, rounded once
        torch.testing.assert_close(a, c, rtol=1.6e-2, atol=1e-3)


def test_row_op_eager_gradient_is_the_softmax_formula():
    """The eager row op against the formula written out: loss and in-place gradient."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 11, generator=g, dtype=torch.float64) * 4
    y = torch.tensor([3, -100, 0, 10, 5, -100])
    scale = torch.rand(6, generator=g, dtype=torch.float64)
    s = 0.2
    logp = torch.log_softmax(x, 1)
    valid = y != -100
    onehot = torch.nn.functional.one_hot(y.clamp_min(0), 11).to(x.dtype)
    want_loss = torch.where(valid, -(1 - s) * (logp * onehot).sum(1) - s * logp.mean(1), 0)
    want_grad = (logp.exp() - (1 - s) * onehot - s / 11) * torch.where(valid, scale, 0)[:, None]
    got = x.clone()
    loss = ce_rows_eager(got, y, scale, ignore_index=-100, smoothing=s, grad=True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want_grad, rtol=1e-12, atol=1e-12)


def test_fused_chunk_size_fits_the_buffer():
    # bf16 at Qwen3's vocabulary and at the e2e one: 2,048 rows, within the buffer
    for vocab in (151936, 32768):
        rows = fused_chunk_size(16384, vocab, torch.bfloat16)
        assert rows == 2048 and rows * vocab * 2 <= LOGITS_BUFFER_BYTES
    assert fused_chunk_size(16384, 1 << 20, torch.bfloat16) == 512  # a larger vocabulary
    assert fused_chunk_size(100, 32768, torch.float32) == 100
    assert fused_chunk_size(10**6, 10**8, torch.float32) == 128  # floor for huge vocabularies


def test_fused_under_autocast_computes_in_the_autocast_dtype():
    """fp32 parameters under bf16 autocast: the head's GEMMs run in bf16 as F.linear's
    would (the stock loss to fp32 rounding, not the more exact fp32 one), gradients fp32."""
    h, w, b, y = _inputs(37, 16, 50, 0.2, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l0, g0 = _loss_and_grads(ref.linear_cross_entropy_reference, h, w, b, y)
        l1, g1 = _loss_and_grads(
            lambda *a: linear_cross_entropy(*a, chunk_size=8, backend="fused"), h, w, b, y
        )
    exact = ref.linear_cross_entropy_reference(h, w, y, b)
    assert (l0 - exact).abs() > 1e-4  # bf16 logits: the check below can tell them apart
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    for a, c in zip(g1, g0):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, c, rtol=1.6e-2, atol=1e-3)


def test_cpu_logits_take_the_eager_row_op():
    """The Triton row op registers on the first pick for a CUDA tensor; registered, it is
    never picked for CPU tensors, not even where the interpreter could run it."""
    from dropless.ops.linear_cross_entropy.rows import CE_ROWS, ce_rows_names

    assert CE_ROWS.pick(None, torch.empty(2, 3)).name == "eager"
    CE_ROWS.load_gpu()
    assert ce_rows_names()[:1] == ["triton"] and "eager" in ce_rows_names()
    assert CE_ROWS.pick(None, torch.empty(2, 3)).name == "eager"
