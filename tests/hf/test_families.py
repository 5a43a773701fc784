"""Whole models: patched == stock eager (logits, loss, every gradient, aux loss), greedy
generation, save/load round trip; the expert score bias for the families with a biased
router. ALL covers the seven first families and those that once fell back to stock."""

# T tokens, E experts, K top-k

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from families import FAMILIES, MORE_FAMILIES, auto_class, build, clone_into

import dropless
import dropless.hf as dh
from dropless.hf import experts as ex

VOCAB = 96
ALL = FAMILIES + MORE_FAMILIES


def _calls() -> int:
    return sum(ex.CALLS.values())


def _ids(seed=1, B=2, L=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (B, L), generator=g)


def _run_patched(fn):
    """Run fn() recording warnings; fail on any dropless fallback warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    fallbacks = [w for w in caught if issubclass(w.category, dh.DroplessFallbackWarning)]
    assert not fallbacks, [str(w.message) for w in fallbacks]
    return out


@pytest.mark.parametrize("family", ALL)
def test_training_step_matches_stock_eager(family):
    stock = build(family, "eager")
    dropless.patch()
    patched = clone_into(stock, None)  # built after patch(): dropless is the default
    assert patched.get_experts_implementation()[""] == "dropless"
    n_moe = len(dh.moe_layers(patched))
    assert n_moe >= 1
    ids = _ids()
    try:
        ref = stock(ids, labels=ids, output_router_logits=True)
    except AttributeError as e:  # granitemoe on transformers 5.17: aux_loss is an int there
        pytest.skip(f"stock eager itself fails on this transformers version: {e}")
    before = _calls()
    out = _run_patched(lambda: patched(ids, labels=ids, output_router_logits=True))
    assert _calls() - before == n_moe  # every MoE layer ran the dropless path
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    if getattr(ref, "aux_loss", None) is not None:  # families with a load-balancing loss
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=0)
    ref.loss.backward()
    out.loss.backward()
    grads = dict(stock.named_parameters())
    checked = 0
    for name, p in patched.named_parameters():
        g_ref = grads[name].grad
        if g_ref is None:  # unused by this input (a vision tower) or not trained (a bias)
            assert p.grad is None, name
            checked += 1
            continue
        assert p.grad is not None, name
        scale = float(g_ref.abs().max())
        torch.testing.assert_close(p.grad, g_ref, rtol=1e-4, atol=1e-5 * scale, msg=name)
        checked += 1
    assert checked == len(grads)


@pytest.mark.parametrize("family", ALL)
def test_greedy_generation_matches(family):
    stock = build(family, "eager").eval()
    dh.patch_model(patched := clone_into(stock, "eager").eval())
    prompt = _ids(seed=2, B=1, L=5)
    with torch.no_grad():
        ref = stock.generate(
            prompt,
            max_new_tokens=3,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        before = _calls()
        got = _run_patched(
            lambda: patched.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        )
    assert _calls() > before
    # compare ids up to the first step whose top-2 margin is too small to be decisive
    n_sure = 0
    for scores in ref.scores:
        top2 = scores[0].topk(2).values
        if float(top2[0] - top2[1]) <= 1e-3:
            break
        n_sure += 1
    L = prompt.shape[1]
    assert torch.equal(got[0, : L + n_sure], ref.sequences[0, : L + n_sure])
    # teacher-forced on the stock sequence, the logits agree everywhere
    with torch.no_grad():
        torch.testing.assert_close(
            patched(ref.sequences).logits, stock(ref.sequences).logits, rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("family", ALL)
def test_save_pretrained_loads_in_stock(family, tmp_path):

    model = build(family, "eager")
    dh.patch_model(model)
    ids = _ids(seed=3)
    with torch.no_grad():
        patched_logits = model(ids).logits
    model.save_pretrained(tmp_path)
    dh.unpatch()  # stock Transformers from here on
    assert model.get_experts_implementation()[""] == "eager"  # back to what it had
    stock = auto_class(model.config).from_pretrained(
        tmp_path, attn_implementation="eager", experts_implementation="eager"
    )
    with torch.no_grad():
        assert torch.equal(stock(ids).logits, model(ids).logits)  # same weights, same path
        torch.testing.assert_close(stock(ids).logits, patched_logits, rtol=1e-4, atol=1e-5)


def _expected_weights(family, router, logits_TE, ids_TK):
    """The stock semantics of the weights for given choices: unbiased scores of the chosen."""
    if family == "gpt_oss":
        return F.softmax(logits_TE.gather(1, ids_TK), dim=1)
    if family in ("deepseek_v3", "glm4_moe"):
        w = logits_TE.float().sigmoid().gather(1, ids_TK)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    w = logits_TE.float().softmax(-1).gather(1, ids_TK)
    if family == "mixtral" or router.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_bias_changes_selection_not_weights(family):
    model = build(family, "eager")
    ids = _ids(seed=4)
    with torch.no_grad():
        ref_logits = model(ids).logits
    dh.patch_model(model, expert_bias=True)
    layers = dh.moe_layers(model)
    for layer in layers:
        bias = layer.expert_bias
        assert (
            bias is not None and bias.dtype == torch.float32 and bias.shape == (layer.num_experts,)
        )
        own = hasattr(layer.router, "e_score_correction_bias")
        assert own == (family in ("deepseek_v3", "glm4_moe"))
        assert (
            (bias is layer.router.e_score_correction_bias)
            if own
            else ("expert_bias" in dict(layer.router.named_buffers()))
        )
    with torch.no_grad():
        # zero added bias (or the model's own bias): same numbers as stock
        torch.testing.assert_close(model(ids).logits, ref_logits, rtol=1e-4, atol=1e-5)
        layer = layers[-1]
        router = layer.router
        h_TD = torch.randn(12, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
        logits0, w0, ids0 = router(h_TD)
        favoured = int(ids0[0, -1])  # an expert token 0 picks last; bias it to the top
        layer.expert_bias[favoured] += 100.0
        logits1, w1, ids1 = router(h_TD)
        assert torch.equal(logits1, logits0)  # the bias never touches the logits
        assert bool((ids1 == favoured).any(-1).all())  # every token now picks it
        assert not torch.equal(ids1, ids0)
        torch.testing.assert_close(
            w1.float(), _expected_weights(family, router, logits1, ids1), rtol=1e-5, atol=1e-6
        )  # weights: unbiased scores of the chosen
        model(ids)
        assert int(layer.tokens_per_expert[favoured]) == ids.numel()
