"""Every op against its pure-torch reference, forward and backward, with named edge cases."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs, N out features

import pytest
import torch

from dropless import ops
from dropless.ops import reference as ref

RTOL, ATOL = 1e-5, 1e-5


def make_ids(case: str, T: int, E: int, K: int) -> torch.Tensor:
    """Expert ids [T, K] (distinct per token) for a named routing case."""
    if case == "all_on_one":  # every token's first choice is expert 0
        rest = (
            torch.stack([torch.randperm(E - 1)[: K - 1] + 1 for _ in range(T)]) if K > 1 else None
        )
        first = torch.zeros(T, 1, dtype=torch.long)
        return first if rest is None else torch.cat([first, rest], 1)
    if case == "zero_tokens_expert":  # expert E-1 never chosen
        return torch.stack([torch.randperm(E - 1)[:K] for _ in range(T)])
    return torch.stack([torch.randperm(E)[:K] for _ in range(T)])


CASES = {
    # name: (T, E, K, ids case)
    "random": (16, 6, 2, "random"),
    "zero_tokens_expert": (12, 5, 2, "zero_tokens_expert"),
    "all_on_one": (10, 4, 1, "all_on_one"),
    "T=1": (1, 4, 2, "random"),
    "K=E": (6, 3, 3, "random"),
    "E_not_pow2": (9, 7, 3, "random"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_permute_unpermute_match_reference(case):
    T, E, K, kind = CASES[case]
    D = 5
    ids = make_ids(kind, T, E, K)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    sp = ops.sort_by_expert(ids, E)
    x_ref, tok_ref, counts_ref = ref.permute_reference(x, ids, E)
    x_SD = ops.permute(x, sp)
    torch.testing.assert_close(x_SD, x_ref, rtol=0, atol=0)
    assert torch.equal(sp.token_S, tok_ref) and sp.counts == counts_ref.tolist()
    y = torch.randn(sp.num_slots, D, dtype=torch.float64, requires_grad=True)
    out = ops.unpermute(y, sp, w)
    out_ref = ref.unpermute_reference(y, ids, w, E)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum() + (x_SD * y.detach()).sum(), (x, w, y))
    grads_ref = torch.autograd.grad((out_ref * g).sum() + (x_ref * y.detach()).sum(), (x, w, y))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_permute_unpermute_gradcheck():
    ids = make_ids("random", 5, 4, 2)
    sp = ops.sort_by_expert(ids, 4)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: ops.permute(x, sp), (x,))
    y = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, w: ops.unpermute(y, sp, w), (y, w))
    assert torch.autograd.gradcheck(lambda y: ops.unpermute(y, sp), (y,))


def test_dropless_invariants():
    T, E, K, D = 32, 8, 3, 4
    ids = make_ids("random", T, E, K)
    sp = ops.sort_by_expert(ids, E)
    assert sum(sp.counts) == T * K and sp.num_dropped == 0
    x = torch.randn(T, D)
    torch.testing.assert_close(ops.unpermute(ops.permute(x, sp), sp), K * x, rtol=1e-6, atol=1e-6)
    assert torch.equal(
        ops.unpermute(ops.permute(x, sp), sp, torch.ones(T, K)),
        ops.unpermute(ops.permute(x, sp), sp),
    )


def test_unpermute_is_deterministic():
    ids = make_ids("random", 64, 8, 4)
    sp = ops.sort_by_expert(ids, 8)
    y, w = torch.randn(256, 16), torch.rand(64, 4)
    assert torch.equal(ops.unpermute(y, sp, w), ops.unpermute(y, sp, w))


@pytest.mark.parametrize("backend", ["auto", "loop", "grouped_mm"])
@pytest.mark.parametrize("trans_w", [True, False], ids=["w_END", "w_EDN"])
@pytest.mark.parametrize(
    "case", ["random", "zero_tokens_expert", "all_on_one", "T=1", "E_not_pow2"]
)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_grouped_gemm_matches_reference(backend, trans_w, case, bias):
    T, E, K, kind = CASES[case]
    D, N = 8, 12  # multiples of 4 so grouped_mm's 16-byte alignment holds in fp32
    ids = make_ids(kind, T, E, K)
    counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    S = sum(counts)
    x = torch.randn(S, D, requires_grad=True)
    w = (
        torch.randn(E, N, D, requires_grad=True)
        if trans_w
        else torch.randn(E, D, N, requires_grad=True)
    )
    b = torch.randn(E, N, requires_grad=True) if bias else None
    y = ops.grouped_gemm(x, w, counts, b, trans_w=trans_w, backend=backend)
    y_ref = ref.grouped_gemm_reference(x, w, counts, b, trans_w=trans_w)
    torch.testing.assert_close(y, y_ref, rtol=RTOL, atol=ATOL)
    g = torch.randn_like(y)
    inputs = (x, w) + ((b,) if bias else ())
    for a, r in zip(torch.autograd.grad(y, inputs, g), torch.autograd.grad(y_ref, inputs, g)):
        torch.testing.assert_close(a, r, rtol=RTOL, atol=ATOL)


def test_grouped_gemm_expanded_gradient():
    # .sum() hands backward an expanded (stride-0) gradient, which grouped_mm rejects
    x, w = torch.randn(8, 4, requires_grad=True), torch.randn(2, 4, 4, requires_grad=True)
    ops.grouped_gemm(x, w, [3, 5]).sum().backward()
    gx, gw = torch.autograd.grad(ref.grouped_gemm_reference(x, w, [3, 5]).sum(), (x, w))
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(w.grad, gw)


def test_grouped_gemm_fp64_gradcheck():
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: ops.grouped_gemm(x, w, [2, 0, 5], b), (x, w, b))
    assert torch.autograd.gradcheck(
        lambda x, w, b: ref.grouped_gemm_reference(x, w, [2, 0, 5], b), (x, w, b)
    )


def test_grouped_gemm_named_backend_errors():
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="grouped_mm"):
        ops.grouped_gemm(
            x, w, [2, 2], backend="grouped_mm"
        )  # fp64: not supported, no silent fallback
    with pytest.raises(ValueError, match="known"):
        ops.grouped_gemm(x, w, [2, 2], backend="nope")
    with pytest.raises(ValueError, match="sum"):
        ops.grouped_gemm(x, w, [2, 3])
    with pytest.raises(ValueError, match="groups"):
        ops.grouped_gemm(x, w, [4])
    with pytest.raises(ValueError, match=">= 0"):
        ops.grouped_gemm(x, w, [5, -1])


@pytest.mark.parametrize("with_prob", [True, False])
@pytest.mark.parametrize(
    "activation,interleaved",
    [("swiglu", False), ("swiglu", True), ("gpt_oss", True), ("gpt_oss", False)],
)
def test_swiglu(with_prob, activation, interleaved):
    h = (torch.randn(9, 10, dtype=torch.float64) * 5).requires_grad_(
        True
    )  # wide range hits the clamps
    p = torch.rand(9, dtype=torch.float64, requires_grad=True) if with_prob else None
    args = (h, p) if with_prob else (h,)

    def fn(h, p=None):
        return ops.swiglu(h, p, activation=activation, interleaved=interleaved)

    assert torch.autograd.gradcheck(fn, args)
    if activation == "swiglu" and not interleaved:
        torch.testing.assert_close(fn(*args), ref.swiglu_reference(*args))
        assert torch.autograd.gradcheck(ref.swiglu_reference, args)
    if activation == "gpt_oss":
        g, u = (h[:, 0::2], h[:, 1::2]) if interleaved else h.chunk(2, -1)
        g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
        want = g * torch.sigmoid(1.702 * g) * (u + 1) * (p.unsqueeze(1) if with_prob else 1)
        torch.testing.assert_close(fn(*args), want)


def test_swiglu_bad_input():
    with pytest.raises(ValueError, match="activation"):
        ops.swiglu(torch.randn(2, 4), activation="relu")
    with pytest.raises(ValueError, match=r"\[S, 2F\]"):
        ops.swiglu(torch.randn(2, 3))


def test_route_softmax_renormalized():
    logits = torch.randn(20, 8)
    w, ids, scores = ops.route(logits, 2, renormalize=True)
    p = logits.softmax(-1)
    top = p.topk(2, -1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(w, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(w.sum(-1), torch.ones(20))


def test_route_scores_in_fp32_for_bf16_logits():
    w, ids, scores = ops.route(torch.randn(4, 6, dtype=torch.bfloat16), 2)
    assert w.dtype == torch.float32 and scores.dtype == torch.float32 and ids.dtype == torch.int64


def test_route_sigmoid_group_limited_bias_scaling():
    T, E, G, TG, K = 30, 16, 4, 2, 4
    logits = torch.randn(T, E)
    bias = torch.randn(E) * 0.5
    w, ids, scores = ops.route(
        logits,
        K,
        score_func="sigmoid",
        renormalize=True,
        scaling_factor=2.5,
        n_group=G,
        topk_group=TG,
        expert_bias_E=bias,
    )
    s = logits.sigmoid()
    for t in range(T):
        choice = s[t] + bias
        gscore = choice.view(G, E // G).topk(2, -1).values.sum(-1)
        groups = set(gscore.topk(TG).indices.tolist())
        allowed = [e for e in range(E) if e // (E // G) in groups]
        best = sorted(allowed, key=lambda e: -choice[e])[:K]
        assert set(ids[t].tolist()) == set(best)  # selection uses the bias and the groups
        sel = s[t, ids[t]]
        torch.testing.assert_close(w[t], 2.5 * sel / sel.sum())  # weights do not use the bias


def test_expert_bias_changes_selection_not_weights():
    logits = torch.zeros(5, 4)
    logits[:, 0] = 1.0
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, ids, scores = ops.route(logits, 1, score_func="sigmoid", expert_bias_E=bias)
    assert (ids == 3).all()
    torch.testing.assert_close(w[:, 0], torch.full((5,), 0.5))


def test_route_gradcheck():
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    for kw in (dict(renormalize=True), dict(score_func="sigmoid", scaling_factor=2.0)):
        assert torch.autograd.gradcheck(lambda z, kw=kw: ops.route(z, 2, **kw)[0], (logits,))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=5), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=2, score_func="tanh"), "score_func"),
        (dict(top_k=2, n_group=3, topk_group=1), "n_group"),
        (dict(top_k=2, n_group=2), "topk_group"),
        (dict(top_k=3, n_group=4, topk_group=1), "fewer than top_k"),
    ],
)
def test_route_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.route(torch.randn(3, 4), **kwargs)


def test_capacity_drops_lowest_weight_first():
    ids = torch.tensor([[0], [0], [0], [1]])
    w = torch.tensor([[0.2], [0.9], [0.5], [0.3]])
    keep = ops.capacity_keep_mask(ids, w, 2, capacity=2)
    assert keep.view(-1).tolist() == [False, True, True, True]
    # ties: the earlier pair wins
    keep = ops.capacity_keep_mask(ids, torch.full((4, 1), 0.5), 2, capacity=2)
    assert keep.view(-1).tolist() == [True, True, False, True]
    assert ops.expert_capacity(10, 2, 4, 1.0) == 5


def test_losses():
    T, E, K = 40, 8, 2
    logits = torch.randn(T, E)
    w, ids, scores = ops.route(logits, K)
    # Transformers' definition: E * sum over (k, e) of mean_t onehot[t, k, e] * mean_t p[t, e]
    onehot = torch.nn.functional.one_hot(ids, E).float()
    want = E * (onehot.mean(0) * scores.mean(0).unsqueeze(0)).sum()
    torch.testing.assert_close(ops.load_balancing_loss(scores, ids), want)
    # perfectly balanced routing gives K
    flat = torch.full((E, E), -1e9)
    flat[torch.arange(E), torch.arange(E)] = 0
    s = torch.full((E, E), 1.0 / E)
    torch.testing.assert_close(
        ops.load_balancing_loss(s, torch.arange(E).view(E, 1)), torch.tensor(1.0)
    )
    torch.testing.assert_close(ops.z_loss(logits), torch.logsumexp(logits, -1).square().mean())
    # sequence aux loss: uniform scores, balanced hits -> 1
    B, L = 2, E
    sc = torch.full((B, L, E), 1.0 / E)
    hits = torch.arange(E).view(1, E, 1).expand(B, L, 1)
    torch.testing.assert_close(ops.sequence_aux_loss(sc, hits), torch.tensor(1.0))


def test_expert_bias_update():
    bias = torch.zeros(4)
    ops.update_expert_bias(bias, torch.tensor([10, 0, 5, 5]), rate=0.1)
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
