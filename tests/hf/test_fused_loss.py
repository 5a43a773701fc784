"""enable_fused_cross_entropy: a tiny Qwen3-MoE returns stock's loss and gradients with
`logits=None` when given labels (padding, num_items_in_batch, router aux loss included)."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, build, labelled_batch, loss_step

from dropless.hf.fusions.fused_loss import (
    disable_fused_cross_entropy,
    enable_fused_cross_entropy,
    is_fused_cross_entropy_enabled,
)

BACKENDS = ["fused"]


def _assert_same(a, b):
    out_a, grads_a = a
    out_b, grads_b = b
    torch.testing.assert_close(out_b.loss, out_a.loss, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_and_grads_equal_stock(backend):
    model = build("qwen3_moe")
    ids, labels = labelled_batch()
    calls = [
        dict(input_ids=ids, labels=labels),
        dict(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(11)),
        dict(input_ids=ids, labels=labels, output_router_logits=True),
    ]
    stock = [loss_step(model, **kw) for kw in calls]
    assert all(s[0].logits.shape == (2, 9, 96) for s in stock)
    enable_fused_cross_entropy(model, chunk_size=5, backend=backend)
    assert is_fused_cross_entropy_enabled(model)
    for kw, ref in zip(calls, stock):
        fused = loss_step(model, **kw)
        assert fused[0].logits is None
        _assert_same(ref, fused)
    assert stock[2][0].aux_loss is not None
    torch.testing.assert_close(fused[0].aux_loss, stock[2][0].aux_loss)


def test_on_loss_is_called_with_each_cross_entropy():
    model = build("qwen3_moe")
    ids, labels = labelled_batch(seed=3)
    kw = dict(input_ids=ids, labels=labels, output_router_logits=False)
    with torch.no_grad():
        stock = model(**kw).loss
        seen = []
        enable_fused_cross_entropy(model, on_loss=seen.append)
        model(**kw)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], stock, rtol=1e-5, atol=1e-6)
    later = []
    enable_fused_cross_entropy(model, on_loss=later.append)  # enabled: sets the callback
    with torch.no_grad():
        model(**kw)
    assert len(seen) == 1 and len(later) == 1


def test_without_labels_tuple_output_and_disable():
    model = build("qwen3_moe")
    ids, labels = labelled_batch(seed=2)
    with torch.no_grad():
        stock_logits = model(input_ids=ids).logits
        stock_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    enable_fused_cross_entropy(model)
    enable_fused_cross_entropy(model)  # idempotent
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, stock_logits)
        fused_tuple = model(input_ids=ids, labels=labels, return_dict=False)
        # the head used on its own still gives logits
        hidden = model.model(input_ids=ids).last_hidden_state
        torch.testing.assert_close(model.lm_head(hidden), stock_logits)
    # stock tuple: (loss, logits, ...); fused: logits left out like any None field
    assert len(fused_tuple) == len(stock_tuple) - 1
    torch.testing.assert_close(fused_tuple[0], stock_tuple[0])
    disable_fused_cross_entropy(model)
    assert not is_fused_cross_entropy_enabled(model)
    assert "forward" not in vars(model) and "forward" not in vars(model.lm_head)
    assert "_loss_function" not in vars(model)
    with torch.no_grad():
        again = model(input_ids=ids, labels=labels)
    assert again.logits is not None
    torch.testing.assert_close(again.loss, stock_tuple[0])


def test_refuses_models_it_cannot_reproduce():
    model = build("qwen3_moe")
    model.config.logits_scaling = 4.0
    with pytest.raises(ValueError, match="logits_scaling"):
        enable_fused_cross_entropy(model)
    model.config.logits_scaling = None
    model.loss_function = lambda *a, **k: None
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        enable_fused_cross_entropy(model)
    with pytest.raises(TypeError, match="nn.Linear"):
        enable_fused_cross_entropy(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_logits_changed_after_the_head_is_an_error():
    model = build("qwen3_moe")
    enable_fused_cross_entropy(model)
    head_forward = model.lm_head.forward
    model.lm_head.forward = lambda h: head_forward(h) * 2.0  # a family-style logit scaling
    ids, labels = labelled_batch()
    with pytest.raises(ValueError, match="transforms its logits"):
        model(input_ids=ids, labels=labels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_full_logits_kept_for_backward(backend):
    """Stock keeps the [B, L, V] logits for backward; the fused head keeps none."""
    model = build("qwen3_moe")
    ids, labels = labelled_batch()
    B, L, V = *ids.shape, model.config.vocab_size

    def logits_sized_saved(m):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(input_ids=ids, labels=labels)
        return [s for s in shapes if s and s[-1] == V and torch.Size(s).numel() >= B * L * V]

    assert logits_sized_saved(model)  # the check sees stock's logits
    enable_fused_cross_entropy(model, chunk_size=4, backend=backend)
    assert logits_sized_saved(model) == []


def test_disable_restores_forwards_set_on_the_instance():
    model = build("qwen3_moe")
    seen = []
    model_forward, head_forward = model.forward, model.lm_head.forward

    def traced_forward(*a, **k):
        seen.append("model")
        return model_forward(*a, **k)

    def traced_head(h):
        seen.append("head")
        return head_forward(h)

    model.forward, model.lm_head.forward = traced_forward, traced_head
    enable_fused_cross_entropy(model)
    ids, labels = labelled_batch()
    with torch.no_grad():
        assert model(input_ids=ids).logits is not None
        fused = model(input_ids=ids, labels=labels)
        positional = model(ids, None, None, None, None, labels)
    # the earlier wrappers still run; with labels the head's logits are never computed
    assert seen == ["model", "head", "model", "model"]
    assert fused.logits is None and positional.logits is None
    torch.testing.assert_close(positional.loss, fused.loss)
    disable_fused_cross_entropy(model)
    assert vars(model)["forward"] is traced_forward
    assert vars(model.lm_head)["forward"] is traced_head


# granitemoe divides its logits by logits_scaling (1.0 here) before the loss
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3_moe"] + ["granitemoe"])
def test_other_families_equal_stock(family):
    model = build(family)
    ids, labels = labelled_batch(seed=3)
    kw = dict(input_ids=ids, labels=labels, output_router_logits=True)
    stock = loss_step(model, **kw)
    enable_fused_cross_entropy(model, chunk_size=7)
    fused = loss_step(model, **kw)
    assert fused[0].logits is None
    _assert_same(stock, fused)
