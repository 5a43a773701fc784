"""linear_cross_entropy against F.cross_entropy(F.linear(...)): label smoothing, batched
shapes, what it keeps, bad calls (its "fused" backend's cases: test_fused_linear_ce.py);
and `cross_entropy`, the row op as an autograd Function on logits a caller holds."""

# T tokens, D hidden, V vocabulary

import pytest
import torch

from dropless.ops import linear_cross_entropy
from dropless.ops import reference as ref

CASES = {
    # name: (T, D, V, chunk, fraction of labels ignored)
    "multi_chunk": (37, 16, 50, 8, 0.3),  # T not a multiple of the chunk
    "V_odd_one_chunk": (12, 8, 23, 64, 0.0),
    "T=1": (1, 8, 11, 4, 0.0),
    "all_ignored": (9, 8, 13, 4, 1.0),
    "chunk=1": (5, 4, 7, 1, 0.2),
}


def _inputs(T, D, V, ignored, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    y = torch.randint(0, V, (T,), generator=g)
    y[torch.rand(T, generator=g) < ignored] = -100
    return h, w, b, y


def _loss_and_grads(fn, h, w, b, y, scale=1.7):
    loss = fn(h, w, y, b)
    params = [t for t in (h, w, b) if t is not None]
    # a fixed, uneven upstream gradient (per token for reduction='none')
    upstream = (
        torch.linspace(-1, 2, loss.numel()).to(loss.dtype).reshape(loss.shape)
        if loss.dim()
        else scale
    )
    grads = torch.autograd.grad((loss * upstream).sum(), params)
    return loss, grads


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.1, 1.0])
def test_label_smoothing_matches_reference(smoothing, reduction):
    h, w, b, y = _inputs(29, 12, 31, 0.25, torch.float32, seed=3)
    kw = dict(label_smoothing=smoothing, reduction=reduction)
    l0, g0 = _loss_and_grads(lambda *a: ref.linear_cross_entropy_reference(*a, **kw), h, w, b, y)
    l1, g1 = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_size=8, **kw), h, w, b, y)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    for a, c in zip(g1, g0):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_never_saves_full_logits():
    """No tensor of T*V elements is kept for backward (the point of the op)."""
    T, D, V = 64, 8, 96
    h, w, _, y = _inputs(T, D, V, 0.0, torch.float32, bias=False)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_cross_entropy(h, w, y, chunk_size=16)
    assert sizes and max(sizes) <= max(T * D, V * D) < T * V
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ref.linear_cross_entropy_reference(h, w, y)
    assert max(sizes) >= T * V  # the composition does keep them


def test_batched_shapes_and_auto_backend():
    h, w, b, y = _inputs(24, 8, 17, 0.2, torch.float32)
    h3, y3 = h.reshape(2, 12, 8), y.reshape(2, 12)
    loss = linear_cross_entropy(h3, w, y3, b)
    torch.testing.assert_close(loss, ref.linear_cross_entropy_reference(h, w, y, b))


def test_bad_input():
    h, w, b, y = _inputs(4, 8, 10, 0.0, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(h, w, y, backend="cuda")
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, reduction="avg")
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(h, w[:, :4], y)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, y[:3])
    with pytest.raises(TypeError, match="int64"):
        linear_cross_entropy(h, w, y.int())
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(h, w, y, label_smoothing=1.5)


@pytest.mark.gpu
def test_bf16_on_cuda_matches_the_stock_head():
    """On CUDA the fused backend's weight gradient runs bf16 GEMMs with an fp32 sum
    (not an fp32 SIMT GEMM): loss and gradients within bf16 rounding of the stock head."""
    h, w, b, y = (t.cuda() for t in _inputs(300, 64, 500, 0.25, torch.bfloat16))
    l0, g0 = _loss_and_grads(ref.linear_cross_entropy_reference, h, w, b, y)
    l1, g1 = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_size=128), h, w, b, y)
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-4)
    for a, c in zip(g1, g0):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), c.float(), rtol=2e-2, atol=2e-3)


def test_backends_are_one_registry():
    """ "auto" picks through the registry `CE_BACKENDS`; a per-token loss is refused."""
    from dropless.ops.linear_cross_entropy import CE_BACKENDS
    from dropless.ops.linear_cross_entropy.eager import _pick

    assert CE_BACKENDS.names() == ["fused"]
    assert _pick("auto", torch.randn(3, 4), "mean", 0.1).name == "fused"
    h, w, _, y = _inputs(4, 8, 10, 0.0, torch.float32)
    with pytest.raises(ValueError, match="reduction='none': expected one of"):
        linear_cross_entropy(h, w, y, reduction="none")


# --- cross_entropy: the row op as an autograd Function on logits the caller has ----------


def _ce_rows_module():
    import sys

    return sys.modules["dropless.ops.linear_cross_entropy.rows"]


def _head(dtype, N=2, L=9, D=8, V=37, seed=0):
    """(h, w, labels): logits = h @ w.T in `dtype` (16-bit from fp32 leaves, as autocast)."""
    g = torch.Generator().manual_seed(seed)
    leaf = torch.float64 if dtype == torch.float64 else torch.float32
    h = torch.randn(N, L, D, generator=g, dtype=leaf).requires_grad_()
    w = torch.randn(V, D, generator=g, dtype=leaf).requires_grad_()
    y = torch.randint(0, V, (N, L), generator=g)
    y[0, -3:] = -100
    y[1, :2] = -100
    return h, w, y


def _ce_step(loss_of, h, w, y, dtype, keep_logits=False, **backward):
    h.grad = w.grad = None
    logits = (h @ w.t()).to(dtype)
    loss = loss_of(logits, y)
    if not keep_logits:
        logits = None
    (loss * 1.7).backward(**backward)
    return loss.detach(), h.grad.clone(), w.grad.clone(), logits


def _stock(reduction):
    def run(logits, y):
        acc = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(acc).reshape(-1, logits.shape[-1])
        return torch.nn.functional.cross_entropy(x, y.reshape(-1), reduction=reduction)

    return run


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cross_entropy_equals_stock(dtype, reduction, monkeypatch):
    """fp64 within 1e-12 of F.cross_entropy (loss and gradients), fp32 within rounding,
    bf16 logits (upcast like stock) the same; chunks of 5 rows with a partial last one."""
    from dropless.ops.linear_cross_entropy.rows import cross_entropy

    monkeypatch.setattr(_ce_rows_module(), "_CHUNK_BYTES", 4 * 37 * 5)
    h, w, y = _head(dtype)
    want = _ce_step(_stock(reduction), h, w, y, dtype)
    got = _ce_step(lambda x, t: cross_entropy(x, t, reduction=reduction), h, w, y, dtype)
    assert got[0].dtype == want[0].dtype == torch.promote_types(dtype, torch.float32)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}[dtype]
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))


def test_cross_entropy_all_ignored_and_argument_checks():
    from dropless.ops.linear_cross_entropy.rows import cross_entropy

    x = torch.randn(4, 5, requires_grad=True)
    y = torch.full((4,), -100)
    loss = cross_entropy(x, y)
    assert torch.isnan(loss)  # 0 / 0, as stock's mean
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, y, reduction="none")
    with pytest.raises(ValueError, match="do not match"):
        cross_entropy(x, y[:3])


def _logits_sized_saved(fn, V, rows):
    """Bytes of the [rows, V]-sized tensors autograd saves while `fn()` runs, and
    whether each shares memory with the logits `fn` returns (fn -> (loss, logits))."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss, logits = fn()
    big = [t for t in saved if t.numel() == rows * V]
    ptr = logits.untyped_storage().data_ptr()
    return [(t.untyped_storage().data_ptr() == ptr, t.numel() * t.element_size()) for t in big]


def test_cross_entropy_keeps_only_the_logits():
    """F.cross_entropy saves its [N, V] log-probabilities; cross_entropy saves nothing
    logits-sized but the logits themselves (the same memory)."""
    from dropless.ops.linear_cross_entropy.rows import cross_entropy

    h, w, y = _head(torch.float32)

    def run(loss_of):
        logits = h @ w.t()
        return loss_of(logits, y), logits

    stock = _logits_sized_saved(lambda: run(_stock("mean")), 37, 18)
    assert (False, 18 * 37 * 4) in stock  # the log-probabilities: new memory
    assert _logits_sized_saved(lambda: run(cross_entropy), 37, 18) == [(True, 18 * 37 * 4)]


def test_cross_entropy_writes_its_gradient_over_logits_no_one_holds(monkeypatch):
    """The backward's gradient buffer: the logits' own memory when the caller let them
    go; a new buffer when the caller holds them (left as they were), when the graph is
    retained (a second backward gives the same gradients) or saved-tensor hooks run."""
    from dropless.ops.linear_cross_entropy.rows import cross_entropy

    rows = _ce_rows_module()
    made = []
    real = torch.empty
    monkeypatch.setattr(rows.torch, "empty", lambda *a, **k: made.append(a) or real(*a, **k))

    def new_buffers():
        n = sum(1 for a in made if a and tuple(a[0]) == (2, 9, 37))
        made.clear()
        return n

    h, w, y = _head(torch.float32)
    want = _ce_step(_stock("mean"), h, w, y, torch.float32)
    got = _ce_step(cross_entropy, h, w, y, torch.float32)
    assert new_buffers() == 0
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b)
    held = _ce_step(cross_entropy, h, w, y, torch.float32, keep_logits=True)
    assert new_buffers() == 1
    torch.testing.assert_close(held[3], (h @ w.t()).detach())  # the caller's, untouched
    grads = []
    logits = h @ w.t()
    loss = cross_entropy(logits, y)
    del logits
    for _ in range(2):
        grads.append(torch.autograd.grad(loss, (h, w), retain_graph=True))
    assert new_buffers() == 2
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        _ce_step(cross_entropy, h, w, y, torch.float32)
    assert new_buffers() == 1


def test_cross_entropy_ownership_reads_torch_storage_counts():
    """The private count `_owns_memory` reads: a tensor alone on its memory counts as a
    fresh one; another tensor on the same memory (a detached alias) adds one."""
    rows = _ce_rows_module()
    x = torch.randn(3, 4)
    fresh = rows._use_count(torch.empty(1))
    assert rows._use_count(x) == fresh
    alias = x.detach()
    assert rows._use_count(x) == fresh + 1
    del alias
    assert rows._use_count(x) == fresh
