"""The per-layer balancing loss of `RouterLosses(model, balance="per_layer")`: each MoE
layer's Switch loss (its own pair counts and mean router probabilities), summed over
layers (each layer at the full coefficient, whatever the depth), against a direct
computation; and the case it exists for: two layers whose pooled
counts are exactly balanced while each layer is not, where the pooled (family) loss gives
the router logits no gradient and the per-layer loss does."""

# B sequences, L tokens per sequence, T tokens, E experts, K top-k

import pytest
import torch
from families import build

import dropless.hf as dh
from dropless.hf.experts.router_losses import BALANCE_LOSSES, RouterLosses

B, L = 2, 7


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, vocab, (B, L), generator=torch.Generator().manual_seed(seed))


def _router_outputs(model):
    seen, handles = [], []
    for layer in dh.moe_layers(model):
        handles.append(layer.router.register_forward_hook(lambda m, a, out: seen.append(out)))
    return seen, handles


def _direct(outputs, E: int) -> torch.Tensor:
    """sum over layers of E * sum_e (c_e / T) * mean_t softmax(logits)[t, e], in float64."""
    per_layer = []
    for logits_TE, _, ids_TK in outputs:
        p_TE = logits_TE.detach().double().softmax(-1)
        T = p_TE.shape[0]
        c_E = torch.bincount(ids_TK.reshape(-1), minlength=E).double()
        per_layer.append(E * ((c_E / T) * p_TE.mean(0)).sum())
    return torch.stack(per_layer).sum()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_per_layer_loss_equals_a_direct_computation(family):
    model = build(family)
    dh.patch_model(model)
    E = model.config.num_experts if family == "qwen3_moe" else model.config.num_local_experts
    ids = _ids(model.config.vocab_size)
    seen, handles = _router_outputs(model)
    rl = RouterLosses(model, balance="per_layer")
    with rl.capture():
        out = model(input_ids=ids, output_router_logits=True)
    for h in handles:
        h.remove()
    st = rl.stats(out, ids.shape)
    assert st.source == "per_layer"
    torch.testing.assert_close(st.aux.double(), _direct(seen, E), rtol=1e-6, atol=0)
    # not the pooled loss the family computes (the layers' counts differ here)
    assert abs(float(st.aux.detach()) - float(out.aux_loss.detach())) > 1e-4
    st.aux.backward()
    assert all(layer.router.weight.grad.abs().sum() > 0 for layer in dh.moe_layers(model))
    # "family" keeps the model's own loss; the constructor's choice can be overridden per call
    assert rl.stats(out, ids.shape, balance="family").source == "model"
    torch.testing.assert_close(
        RouterLosses(model).stats(out, ids.shape).aux, out.aux_loss.float(), rtol=0, atol=0
    )


def _forced_routers(model, logits_ME):
    """Each router returns the given leaf logits (softmax, top-k as Qwen3-MoE's router)."""
    K = model.config.num_experts_per_tok
    for layer, logits_TE in zip(dh.moe_layers(model), logits_ME):

        def forward(h, logits_TE=logits_TE):
            p_TE = logits_TE.softmax(-1)
            w_TK, ids_TK = torch.topk(p_TE, K, -1)
            return logits_TE, (w_TK / w_TK.sum(-1, keepdim=True)).to(h.dtype), ids_TK

        layer.router.forward = forward


def test_pooled_balance_hides_unbalanced_layers():
    """Two layers, E=4, K=2: layer 0 sends every token to experts {0, 1}, layer 1 to {2, 3}.
    Pooled over layers every expert gets a quarter of the pairs: the family's (pooled) loss
    is at its balanced value K and its gradient with respect to the router logits is zero;
    each layer is collapsed, and the per-layer loss pushes both."""
    model = build("qwen3_moe", num_experts=4)
    dh.patch_model(model)
    T, E, K = B * L, 4, 2
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(2, T, E, generator=g) * 0.1
    hot = torch.tensor([[3.0, 3.0, 0.0, 0.0], [0.0, 0.0, 3.0, 3.0]])
    logits = [(hot[m] + noise[m]).requires_grad_() for m in range(2)]
    _forced_routers(model, logits)
    ids = _ids(model.config.vocab_size, 1)
    rl = RouterLosses(model)
    with rl.capture():
        out = model(input_ids=ids, output_router_logits=True)
    assert (rl.counts() == torch.tensor([[T, T, 0, 0], [0, 0, T, T]])).all()
    pooled = rl.stats(out, ids.shape, balance="family")
    per_layer = rl.stats(out, ids.shape, balance="per_layer")
    torch.testing.assert_close(pooled.aux, torch.tensor(float(K)), rtol=1e-6, atol=0)
    g_pooled = torch.autograd.grad(pooled.aux, logits, retain_graph=True)
    g_layer = torch.autograd.grad(per_layer.aux, logits)
    assert max(float(x.abs().max()) for x in g_pooled) < 1e-7
    for x in g_layer:  # each layer's own hot experts are pushed down
        assert float(x.abs().max()) > 1e-3
    assert float(g_layer[0][:, :2].sum()) > 0 and float(g_layer[1][:, 2:].sum()) > 0
    # each layer's loss: E * (1/2 * (p0 + p1)) * 2 with p0 + p1 close to 1, above K; summed
    assert float(per_layer.aux) > 2 * 1.8 * K


def test_cp_group_of_one_and_sequence_form(tmp_path):
    """On a cp group of one the per-layer loss is the loss without cp, gradient included;
    "sequence" takes DeepSeek-V3's sequence-wise loss for a family that has its own."""
    import torch.distributed as dist

    model = build("qwen3_moe")
    ids = _ids(model.config.vocab_size, 2)
    router = dh.moe_layers(model)[0].router.weight
    rl = RouterLosses(model, balance="per_layer")
    with rl.capture():
        out = model(input_ids=ids, output_router_logits=True)
    want = rl.stats(out, ids.shape)
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
    )
    try:
        got = rl.stats(out, ids.shape, cp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got.aux, want.aux, rtol=1e-6, atol=0)
    (g,) = torch.autograd.grad(got.aux, router, retain_graph=True)
    (w,) = torch.autograd.grad(want.aux, router, retain_graph=True)
    torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9)
    seq = rl.stats(out, ids.shape, balance="sequence")
    assert seq.source == "sequence" and abs(float(seq.aux) - float(want.aux)) > 1e-4


def test_balance_is_checked():
    assert BALANCE_LOSSES == ("per_layer", "family", "sequence")
    from dropless.train.config.schema import BALANCE_LOSSES as in_schema

    assert in_schema == BALANCE_LOSSES  # train.balance_loss takes the same names
    model = build("qwen3_moe")
    with pytest.raises(ValueError, match="balance='pooled': must be one of per_layer"):
        RouterLosses(model, balance="pooled")
