"""The fused expert MLP (ops/fused_mlp.py) against the composed path and the reference,
forward and backward, on both of its implementations ("loop", "grouped")."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

import pytest
import torch

from dropless import ops
from dropless.ops import dispatch
from dropless.ops.expert_mlp import composed_mlp
from dropless.ops.expert_mlp.eager import run as fused_mlp
from dropless.ops.expert_mlp.plan import plan_expert_mlp
from dropless.ops.grouped_gemm import backends
from dropless.ops.reference import expert_mlp_reference
from dropless.ops.specs import ActivationConfig


def _ids(T, K, E, g, mode):
    if mode == "one_expert":  # every token's first choice is expert 0
        return torch.stack(
            [
                torch.cat(
                    [
                        torch.zeros(1, dtype=torch.long),
                        torch.randperm(E - 1, generator=g)[: K - 1] + 1,
                    ]
                )
                for _ in range(T)
            ]
        )
    if mode == "empty_expert":  # expert E-1 gets no token
        return torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


def _problem(
    T=6, K=2, E=4, D=8, F=4, *, bias=False, trans_w=True, ids="random", dtype=torch.float32, seed=0
):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=dtype)
    ids_TK = _ids(T, K, E, g, ids)
    w_TK = torch.rand(T, K, generator=g, dtype=dtype)
    gu = torch.randn(E, 2 * F, D, generator=g, dtype=dtype) * 1.5
    dn = torch.randn(E, D, F, generator=g, dtype=dtype)
    if not trans_w:
        gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
    gb = torch.randn(E, 2 * F, generator=g, dtype=dtype) if bias else None
    db = torch.randn(E, D, generator=g, dtype=dtype) if bias else None
    return x, ids_TK, w_TK, gu, dn, gb, db


def _run(fn, x, w_TK, gu, dn, gb, db, seed=1):
    leaves = [
        t.detach().clone().requires_grad_(True) if t is not None else None
        for t in (x, w_TK, gu, dn, gb, db)
    ]
    out = fn(*leaves)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    out.backward(go)
    return [out.detach()] + [t.grad for t in leaves if t is not None]


def _composed(ids_TK, keep_TK, kw):
    """The spec: permute -> grouped_gemm / swiglu autograd nodes -> unpermute."""

    def fn(x, w_TK, gu, dn, gb, db):
        sp = ops.sort_by_expert(ids_TK, gu.shape[0], keep_TK)
        prob_S = w_TK.reshape(-1).index_select(0, sp.pair_S)
        y = composed_mlp(
            ops.permute(x, sp),
            sp.counts,
            prob_S,
            gu,
            dn,
            gate_up_bias=gb,
            down_bias=db,
            alpha=1.702,
            limit=7.0,
            backend="loop",
            **kw,
        )
        return ops.unpermute(y, sp)

    return fn


def _fused(ids_TK, keep_TK, kw, backend):
    def fn(x, w_TK, gu, dn, gb, db):
        return ops.expert_mlp(
            x,
            ids_TK,
            w_TK,
            gu,
            dn,
            keep_TK=keep_TK,
            gate_up_bias=gb,
            down_bias=db,
            backend=backend,
            **kw,
        )[0]

    return fn


CASES = {
    "basic": dict(),
    "biases": dict(bias=True),
    "gpt_oss": dict(activation="gpt_oss", bias=True),
    "interleaved": dict(interleaved=True),
    "gpt_oss_interleaved_untransposed": dict(
        activation="gpt_oss", interleaved=True, trans_w=False, bias=True
    ),
    "trans_w_false": dict(trans_w=False),
    "capacity_dropped": dict(capacity=True, bias=True),
    "expert_with_zero_tokens": dict(ids="empty_expert"),
    "all_tokens_on_one_expert": dict(ids="one_expert", K=1),
    "one_token": dict(T=1),
    "k_equals_e": dict(K=4, E=4),
    "e_not_power_of_two": dict(E=5, K=3, T=7),
}


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_composed_fp32(case, backend):
    c = dict(CASES[case])
    kw = dict(
        activation=c.pop("activation", "swiglu"),
        interleaved=c.pop("interleaved", False),
        trans_w=c.get("trans_w", True),
    )
    capacity = c.pop("capacity", False)
    x, ids_TK, w_TK, gu, dn, gb, db = _problem(**c)
    keep_TK = (
        torch.rand(ids_TK.shape, generator=torch.Generator().manual_seed(5)) > 0.4
        if capacity
        else None
    )
    want = _run(_composed(ids_TK, keep_TK, kw), x, w_TK, gu, dn, gb, db)
    got = _run(_fused(ids_TK, keep_TK, kw, backend), x, w_TK, gu, dn, gb, db)
    names = ["out", "x", "weights", "gate_up", "down", "gate_up_bias", "down_bias"]
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{case}/{backend}: {name}")


def test_fused_matches_reference_with_down_bias():
    x, ids_TK, w_TK, gu, dn, _, db = _problem(T=5, K=2, E=3, bias=True)
    got = _run(
        lambda x, w, gu, dn, db, _: ops.expert_mlp(x, ids_TK, w, gu, dn, down_bias=db)[0],
        x,
        w_TK,
        gu,
        dn,
        db,
        None,
    )
    want = _run(
        lambda x, w, gu, dn, db, _: expert_mlp_reference(x, ids_TK, w, gu, dn, db),
        x,
        w_TK,
        gu,
        dn,
        db,
        None,
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["loop", "grouped"])
@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss"])
def test_fused_gradcheck_fp64(path, activation):
    x, ids_TK, w_TK, gu, dn, gb, db = _problem(
        T=3, K=2, E=3, D=3, F=2, bias=True, dtype=torch.float64
    )
    sp = ops.sort_by_expert(ids_TK, 3)

    def fn(x, w_TK, gu, dn, gb, db):
        prob_S = w_TK.reshape(-1).index_select(0, sp.pair_S)
        return fused_mlp(
            x,
            prob_S,
            gu,
            dn,
            sp.counts,
            token_S=sp.token_S,
            slot_TK=sp.slot_TK,
            num_out=3,
            gate_up_bias=gb,
            down_bias=db,
            activation=activation,
            limit=1.0,
            path=path,
        )

    leaves = [t.requires_grad_(True) for t in (x, w_TK, gu, dn, gb, db)]
    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_grouped_mlp_sorted_rows(backend):
    """grouped_mlp (rows already in expert order, prob None or given) against the spec."""
    g = torch.Generator().manual_seed(2)
    counts, D, F, E = [3, 0, 5, 4], 8, 4, 4
    x = torch.randn(sum(counts), D, generator=g)
    gu, dn = torch.randn(E, 2 * F, D, generator=g), torch.randn(E, D, F, generator=g)
    db = torch.randn(E, D, generator=g)
    for prob in (None, torch.rand(sum(counts), generator=g)):
        for cnt in (counts, torch.tensor(counts)):  # a device tensor keeps grouped_mm sync-free
            leaves = [t.clone().requires_grad_(True) for t in (x, gu, dn, db)]
            got = ops.grouped_mlp(
                leaves[0], cnt, prob, leaves[1], leaves[2], down_bias=leaves[3], backend=backend
            )
            got.sum().backward()
            ref_leaves = [t.clone().requires_grad_(True) for t in (x, gu, dn, db)]
            want = composed_mlp(
                ref_leaves[0],
                counts,
                prob,
                ref_leaves[1],
                ref_leaves[2],
                gate_up_bias=None,
                down_bias=ref_leaves[3],
                activation="swiglu",
                interleaved=False,
                trans_w=True,
                alpha=1.702,
                limit=7.0,
                backend="loop",
            )
            want.sum().backward()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for a, b in zip(leaves, ref_leaves):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_sync_free_sort_matches_host_sort():
    g = torch.Generator().manual_seed(3)
    ids_TK = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(9)])
    a = ops.sort_by_expert(ids_TK, 6)
    b = ops.sort_by_expert(ids_TK, 6, host_counts=False)
    assert b.counts is None and b.num_dropped == 0
    for name in ("token_S", "pair_S", "slot_TK", "counts_E"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(ValueError, match="keep_TK"):
        ops.sort_by_expert(ids_TK, 6, torch.ones_like(ids_TK, dtype=torch.bool), host_counts=False)


@pytest.mark.parametrize("path", ["loop", "grouped"])
def test_saves_only_h_and_indices(path):
    """Per kept pair the Function saves h [2F] + prob + two int64 indices, nothing [S, D]."""
    T, K, E, D, F = 8, 2, 4, 16, 4
    x, ids_TK, w_TK, gu, dn, _, _ = _problem(T=T, K=K, E=E, D=D, F=F)
    leaves = [t.requires_grad_(True) for t in (x, w_TK, gu, dn)]
    sp = ops.sort_by_expert(ids_TK, E)
    prob_S = w_TK.reshape(-1).index_select(0, sp.pair_S).detach()
    held = {t.data_ptr() for t in leaves} | {
        prob_S.data_ptr(),
        sp.token_S.data_ptr(),
        sp.slot_TK.data_ptr(),
    }
    extra = []

    def pack(t):
        if t.data_ptr() not in held:
            extra.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused_mlp(
            leaves[0],
            prob_S,
            leaves[2],
            leaves[3],
            sp.counts,
            token_S=sp.token_S,
            slot_TK=sp.slot_TK,
            num_out=T,
            path=path,
        )
    S = T * K
    assert sum(extra) == S * 2 * F * 4, extra  # only h (fp32) beyond what the caller holds


def test_recipe_keeps_the_composed_path():
    calls = []

    def gemm(x_SD, w, counts, bias, trans_w, recipe):
        calls.append(x_SD.shape)
        return backends.pick_gemm_backend("loop", x_SD, w).mm(x_SD, w, counts, trans_w)

    class Recipe:
        kind = "test-fastpath-recipe"

    dispatch.register_recipe_gemm(Recipe.kind, gemm)
    token = ops.set_recipe(Recipe())
    try:
        x, ids_TK, w_TK, gu, dn, _, _ = _problem()
        out, sp = ops.expert_mlp(x, ids_TK, w_TK, gu, dn)
        # the tokens form (sorted pairs handed in) of a recipe without a fused MLP: the
        # rows form between a gather and a combine, as expert_mlp runs it
        prob_S = w_TK.reshape(-1)[sp.pair_S]
        tokens = dict(token_S=sp.token_S, slot_TK=sp.slot_TK, num_out=x.shape[0])
        again = fused_mlp(x, prob_S, gu, dn, sp.counts, **tokens)
    finally:
        ops.reset_recipe(token)
        dispatch._RECIPE_GEMMS.pop(Recipe.kind)
    assert len(calls) == 4  # gate/up and down went through the recipe's GEMM, twice
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_path_choice_and_errors():
    x, w = torch.randn(2, 8), torch.randn(2, 8, 8)
    swiglu = ActivationConfig()
    assert plan_expert_mlp(x, w, w, swiglu, backend="loop").path == "loop"
    assert plan_expert_mlp(x, w, w, swiglu, backend="grouped_mm").path == "grouped"
    assert plan_expert_mlp(x, w, w, swiglu).path == "loop"  # the CPU default (docs/performance.md)
    x, ids_TK, w_TK, gu, dn, _, _ = _problem()
    with pytest.raises(ValueError, match="activation"):
        ops.expert_mlp(x, ids_TK, w_TK, gu, dn, activation="no_such_kind")
    with pytest.raises(ValueError, match="is not registered"):
        ops.expert_mlp(x, ids_TK, w_TK, gu, dn, backend="nope")
    with pytest.raises(ValueError, match="counts"):
        ops.grouped_mlp(x, [1, 2, 2, 0], None, gu, dn)


@pytest.mark.parametrize("mode", ["frees", "retain_graph"])
def test_loop_backward_frees_each_expert_h_only_with_the_graph(mode):
    """The loop keeps one h per expert and a backward that frees the graph frees each as
    soon as it is read; retain_graph keeps them, and a second backward gives the same
    gradients."""
    T, K, E, D, F = 8, 2, 4, 16, 4
    x, ids_TK, w_TK, gu, dn, _, _ = _problem(T=T, K=K, E=E, D=D, F=F, ids="empty_expert")
    leaves = [t.requires_grad_(True) for t in (x, gu, dn)]
    sp = ops.sort_by_expert(ids_TK, E)
    prob_S = w_TK.reshape(-1).index_select(0, sp.pair_S)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fused_mlp(
            leaves[0], prob_S, leaves[1], leaves[2], sp.counts,
            token_S=sp.token_S, slot_TK=sp.slot_TK, num_out=T, path="loop",
        )  # fmt: skip
    hs = [t for t in saved if t.dim() == 2 and t.shape[1] == 2 * F]
    assert len(hs) == E and sorted(h.shape[0] for h in hs) == sorted(sp.counts)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    if mode == "frees":
        out.backward(go)
        assert all(h.untyped_storage().nbytes() == 0 for h in hs)
        return
    first = torch.autograd.grad(out, leaves, go, retain_graph=True)
    assert all(h.untyped_storage().nbytes() == h.numel() * 4 for h in hs)
    second = torch.autograd.grad(out, leaves, go)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
