"""The lean causal-LM loss `patch()` installs by default: every family's loss and every
gradient equal to F.cross_entropy's in fp64 within 1e-12 (ignored labels, the shift,
`num_items_in_batch`, `shift_labels`), under autocast as stock upcasts the bf16 logits;
logits still returned; no [N, V] log-probabilities kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from families import FAMILIES, MORE_FAMILIES, build, labelled_batch, loss_step

import dropless.hf as dh
from dropless.hf.fusions.causal_lm_loss import (
    causal_lm_loss,
    disable_lean_cross_entropy,
    enable_lean_cross_entropy,
    is_lean_cross_entropy_enabled,
)
from dropless.hf.fusions.fused_loss import disable_fused_cross_entropy, enable_fused_cross_entropy


def _fp64_stock_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                     shift_labels=None, **kwargs):  # fmt: skip
    """Transformers' ForCausalLMLoss with its `logits.float()` left out (fp64 stays)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    red = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                           ignore_index=ignore_index, reduction=red)  # fmt: skip
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _step(model, **kw):
    out, grads = loss_step(model, **kw)
    return out.loss.detach(), out.logits, grads


def _assert_same(got, want, rtol, atol=None):
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the logits, as stock's
    assert got[2].keys() == want[2].keys() and got[2]
    for name, g in want[2].items():
        scale = float(g.abs().max())
        torch.testing.assert_close(got[2][name], g, rtol=rtol, atol=(atol or rtol) * scale)


@pytest.mark.parametrize("family", FAMILIES + MORE_FAMILIES)
def test_every_family_equals_fp64_cross_entropy(family):
    model = build(family).double()
    ids, labels = labelled_batch()
    model.loss_function = _fp64_stock_loss
    want = _step(model, input_ids=ids, labels=labels)
    del vars(model)["_loss_function"]
    assert enable_lean_cross_entropy(model) and is_lean_cross_entropy_enabled(model)
    got = _step(model, input_ids=ids, labels=labels)
    # fp64 logits give an fp64 loss (nemotron_h's head returns fp32 logits)
    assert got[0].dtype == torch.promote_types(got[1].dtype, torch.float32)
    _assert_same(got, want, rtol=1e-12 if got[0].dtype == torch.float64 else 1e-5)


def test_num_items_and_shift_labels_equal_stock_in_fp64():
    model = build("qwen3_moe").double()
    ids, labels = labelled_batch(seed=2)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].clone()
    shifted[0, 0] = -100
    calls = [
        dict(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(11)),
        dict(input_ids=ids, labels=labels, num_items_in_batch=7),
        dict(input_ids=ids, labels=labels, shift_labels=shifted),
    ]
    model.loss_function = _fp64_stock_loss
    want = [_step(model, **kw) for kw in calls]
    model.loss_function = causal_lm_loss
    for kw, w in zip(calls, want):
        _assert_same(_step(model, **kw), w, rtol=1e-12)


def test_autocast_upcasts_the_bf16_logits_as_stock():
    model = build("qwen3_moe")
    ids, labels = labelled_batch(seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _step(model, input_ids=ids, labels=labels)  # stock ForCausalLMLoss
        enable_lean_cross_entropy(model)
        got = _step(model, input_ids=ids, labels=labels)
    assert got[1].dtype == torch.bfloat16 and got[0].dtype == torch.float32
    _assert_same(got, want, rtol=1e-5, atol=1e-2)


def _logits_sized_saved(model, ids):
    V, n = model.config.vocab_size, ids.numel()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    ptr = out.logits.untyped_storage().data_ptr()
    big = [t for t in saved if t.dim() and t.shape[-1] == V and t.numel() == n * V]
    return [t.untyped_storage().data_ptr() == ptr for t in big]


def test_patch_installs_it_by_default_and_keeps_no_log_probabilities():
    """patch(): the loss keeps the logits it returns, nothing else [B*L, V]-sized (stock
    keeps its log-probabilities); `lean_cross_entropy=False` and unpatch() give stock's."""
    ids, _ = labelled_batch()
    stock = build("qwen3_moe")
    assert False in _logits_sized_saved(stock, ids)  # stock's log-probabilities
    dh.patch()
    model = build("qwen3_moe", implementation=None)
    assert is_lean_cross_entropy_enabled(model)
    assert _logits_sized_saved(model, ids) == [True]
    enable_fused_cross_entropy(model)  # on top of it, and back
    assert model(input_ids=ids, labels=ids).logits is None
    disable_fused_cross_entropy(model)
    assert is_lean_cross_entropy_enabled(model)
    dh.unpatch()
    assert not is_lean_cross_entropy_enabled(model)
    dh.patch(lean_cross_entropy=False)
    assert not is_lean_cross_entropy_enabled(build("qwen3_moe", implementation=None))
    dh.unpatch()
    assert is_lean_cross_entropy_enabled(dh.patch_model(build("mixtral")))
    assert disable_lean_cross_entropy(model) is model  # a no-op on a model without it


def test_a_model_with_its_own_loss_keeps_it():
    model = build("qwen3_moe")

    def own(*args, **kwargs):
        return torch.zeros(())

    model.loss_function = own
    assert not enable_lean_cross_entropy(model)
    assert model.loss_function is own
    assert not enable_lean_cross_entropy(model.model)  # a base model computes no loss
