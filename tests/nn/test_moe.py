"""The MoE layer against a naive per-expert loop written here from the definitions."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

import pytest
import torch
import torch.nn.functional as F

import dropless
from dropless import MoE
from dropless.nn import GroupedLinear
from dropless.ops.reference import expert_mlp_reference


def naive_moe(moe: MoE, x_TD: torch.Tensor, semantics: str) -> torch.Tensor:
    """Route each token and run its experts one by one (no dropless code used)."""
    logits = x_TD @ moe.router.weight.t()
    ex = moe.experts
    Fh = ex.intermediate_size
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        if semantics == "qwen3":  # softmax over all experts, top-k, renormalised
            p = logits[t].float().softmax(-1)
            top = p.topk(moe.top_k)
            ids, w = top.indices, top.values / top.values.sum()
        else:  # deepseek_v3: sigmoid, bias-shifted group-limited choice, renorm, scaling
            s = logits[t].float().sigmoid()
            choice = s + moe.router.expert_bias
            G, TG = moe.router.n_group, moe.router.topk_group
            per = moe.num_experts // G
            gs = choice.view(G, per).topk(2, -1).values.sum(-1)
            keep = gs.topk(TG).indices
            masked = torch.full_like(choice, float("-inf"))
            for g in keep.tolist():
                masked[g * per : (g + 1) * per] = choice[g * per : (g + 1) * per]
            ids = masked.topk(moe.top_k).indices
            w = s[ids] / s[ids].sum() * moe.router.scaling_factor
        for e, we in zip(ids.tolist(), w):
            h = ex.gate_up_proj[e] @ x_TD[t]
            if ex.gate_up_proj_bias is not None:
                h = h + ex.gate_up_proj_bias[e]
            a = F.silu(h[:Fh]) * h[Fh:]
            y = ex.down_proj[e] @ a
            if ex.down_proj_bias is not None:
                y = y + ex.down_proj_bias[e]
            out[t] = out[t] + we.to(x_TD.dtype) * y
    if moe.shared_expert is not None:
        se = moe.shared_expert
        y = se.down_proj(F.silu(se.gate_proj(x_TD)) * se.up_proj(x_TD))
        if se.gate is not None:
            y = torch.sigmoid(se.gate(x_TD)) * y
        out = out + y
    return out


def qwen3(**kw):
    return MoE(16, 8, kw.pop("E", 6), kw.pop("K", 2), renormalize=True, **kw)


def deepseek(**kw):
    moe = MoE(
        16,
        8,
        8,
        3,
        score_func="sigmoid",
        renormalize=True,
        scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        expert_bias=True,
        shared_expert_intermediate_size=12,
        **kw,
    )
    moe.router.expert_bias.copy_(torch.randn(8) * 0.3)
    return moe


CASES = {
    # name: (builder, semantics, input shape)
    "qwen3": (lambda: qwen3(), "qwen3", (10, 16)),
    "deepseek_v3": (lambda: deepseek(), "deepseek", (10, 16)),
    "T=1": (lambda: qwen3(), "qwen3", (1, 16)),
    "K=E": (lambda: qwen3(E=3, K=3), "qwen3", (7, 16)),
    "E_not_pow2": (lambda: qwen3(E=7, K=3), "qwen3", (9, 16)),
    "batch_x_seq": (lambda: qwen3(), "qwen3", (2, 5, 16)),
    "down_bias": (lambda: qwen3(bias=True), "qwen3", (10, 16)),
    "shared_gate": (
        lambda: qwen3(shared_expert_intermediate_size=8, shared_expert_gate=True),
        "qwen3",
        (6, 16),
    ),
    "zero_tokens_expert": ("zero", "qwen3", (10, 16)),
    "all_on_one": ("one", "qwen3", (10, 16)),
    "non_contiguous": ("noncontig", "qwen3", (10, 16)),
}


def _build(name):
    builder, semantics, shape = CASES[name]
    if builder == "zero":  # expert 5 can never win: its router row is very negative
        moe = qwen3()
        with torch.no_grad():
            moe.router.weight[5] = -100.0 * moe.router.weight[5].sign()
        x = torch.randn(*shape).abs()
        x = x * moe.router.weight[5].sign().neg().clamp(min=0)
        return moe, semantics, x + 0.01
    if builder == "one":  # every token's top choice is expert 0
        moe = qwen3()
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[0] = 1.0
            moe.router.weight[1:, :8] = 0.01 * torch.randn(5, 8)
        return moe, semantics, torch.randn(*shape).abs() + 0.1
    if builder == "noncontig":
        moe = qwen3()
        return moe, semantics, torch.randn(16, shape[0]).t()
    moe = builder()
    return moe, semantics, torch.randn(*shape)


@pytest.mark.parametrize("name", list(CASES))
def test_moe_matches_naive_loop(name):
    moe, semantics, x = _build(name)
    if moe.experts.down_proj_bias is not None:
        with torch.no_grad():
            moe.experts.down_proj_bias.normal_()
            moe.experts.gate_up_proj_bias.normal_()
    x = x.detach().requires_grad_(True)
    out, aux = moe(x)
    assert out.shape == x.shape
    want = naive_moe(moe, x.reshape(-1, 16), semantics).view_as(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    params = [p for p in moe.parameters()]
    got = torch.autograd.grad(out, [x, *params], g, allow_unused=True)
    ref = torch.autograd.grad(want, [x, *params], g, allow_unused=True)
    for a, b in zip(got, ref):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert aux.dropped == 0
    assert int(aux.tokens_per_expert.sum()) == x.reshape(-1, 16).shape[0] * moe.top_k
    if name == "zero_tokens_expert":
        assert int(aux.tokens_per_expert[5]) == 0
    if name == "all_on_one":
        assert int(aux.tokens_per_expert[0]) == x.shape[0]


def test_moe_fp64_gradcheck():
    moe = qwen3(bias=True).double()
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: moe(x)[0], (x,))


def test_aux_losses():
    moe = qwen3()
    x = torch.randn(20, 16)
    out, aux = moe(x)
    logits = x @ moe.router.weight.t()
    w, ids, scores = dropless.ops.route(logits, 2, renormalize=True)
    torch.testing.assert_close(aux.lb_loss, dropless.ops.load_balancing_loss(scores, ids))
    torch.testing.assert_close(aux.z_loss, dropless.ops.z_loss(logits))
    assert aux.lb_loss.requires_grad


def test_capacity_mode_drops_and_counts():
    moe = qwen3()
    with torch.no_grad():  # everyone prefers expert 0
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0
    x = torch.randn(12, 16).abs() + 0.1
    moe.capacity_factor = 1.0  # capacity ceil(12*2/6) = 4 pairs per expert
    out, aux = moe(x)
    assert int(aux.tokens_per_expert.max()) <= 4
    assert aux.dropped == 12 * 2 - int(aux.tokens_per_expert.sum()) and aux.dropped > 0
    # a dropped pair contributes nothing: compare with a manual computation
    r = moe.router(x)
    keep = dropless.ops.capacity_keep_mask(r.ids_TK, r.weights_TK, 6, 4)
    want = expert_mlp_reference(
        x, r.ids_TK, r.weights_TK * keep, moe.experts.gate_up_proj, moe.experts.down_proj
    )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out.sum().backward()  # backward works with dropped pairs


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: MoE(16, 8, 4, 5), ValueError, "top_k"),
        (lambda: MoE(16, 8, 4, 2, capacity_factor=-1.0), ValueError, "capacity_factor"),
        (lambda: MoE(16, 8, 4, 2, score_func="relu"), ValueError, "score_func"),
        (lambda: MoE(0, 8, 4, 2), ValueError, "hidden_size"),
        (lambda: MoE(16, 8, 4, 2, activation="no_such_kind"), ValueError, "activation"),
    ],
)
def test_moe_bad_config(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_moe_bad_input():
    moe = qwen3()
    with pytest.raises(ValueError, match="hidden_size=16"):
        moe(torch.randn(3, 15))
    with pytest.raises(TypeError, match="floating-point"):
        moe(torch.ones(3, 16, dtype=torch.long))


def test_grouped_linear_matches_per_group_linear():
    gl = GroupedLinear(3, 8, 5, bias=True)
    x = torch.randn(10, 8, requires_grad=True)
    splits = [4, 0, 6]
    y = gl(x, splits)
    want = torch.cat([x[:4] @ gl.weight[0].t() + gl.bias[0], x[4:] @ gl.weight[2].t() + gl.bias[2]])
    torch.testing.assert_close(y, want)
    y2 = gl(x, torch.tensor(splits))
    torch.testing.assert_close(y2, y)
    y.sum().backward()
    assert gl.weight.grad[1].abs().max() == 0 and gl.bias.grad[1].abs().max() == 0
    assert GroupedLinear(2, 4, 4, bias=False).bias is None


@pytest.mark.parametrize(
    "splits,exc,match",
    [
        ([4, 6], ValueError, "num_gemms=3"),
        ([4, -1, 7], ValueError, "non-negative"),
        ([4, 0, 5], ValueError, "sum to 9"),
        (torch.tensor([4.0, 0.0, 6.0]), TypeError, "integer"),
    ],
)
def test_grouped_linear_bad_splits(splits, exc, match):
    with pytest.raises(exc, match=match):
        GroupedLinear(3, 8, 5)(torch.randn(10, 8), splits)


def test_grouped_linear_bad_input():
    gl = GroupedLinear(3, 8, 5)
    with pytest.raises(TypeError, match="floating-point"):
        gl(torch.ones(10, 8, dtype=torch.long), [10, 0, 0])
    with pytest.raises(ValueError, match="in_features=8"):
        gl(torch.randn(10, 7), [10, 0, 0])
    with pytest.raises(ValueError, match="num_gemms"):
        GroupedLinear(0, 8, 5)


def test_public_api():
    for name in ("MoE", "MoEAux", "TopKRouter", "GroupedLinear", "GroupedExperts", "__version__"):
        assert hasattr(dropless, name)
