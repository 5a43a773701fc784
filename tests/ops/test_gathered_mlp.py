"""The engine's row-gathering slots on CPU: the four fusable GEMMs of a schedule run by
torch stand-ins of the Triton kernels (`plan.GatherKernels`: gather the rows, GEMM, the
eager activation or its backward), so the engine's fused-slot forward and backward
schedule is checked against the reference in fp32 (forward and every gradient), its
backward freeing h and the recomputed a before the weight gradients that do not read
them, and the plan's rules for the gathered path (opt-in, never picked on CPU)."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

import dataclasses

import pytest
import torch

from dropless.ops import sort_by_expert
from dropless.ops.activation.eager import act_bwd_eager, act_fwd_eager
from dropless.ops.expert_mlp.eager import run as fused_mlp
from dropless.ops.expert_mlp.plan import GatherKernels, plan_expert_mlp
from dropless.ops.grouped_gemm import backends
from dropless.ops.reference import expert_mlp_reference
from dropless.ops.specs import ActivationConfig

GPT_OSS = ActivationConfig("gpt_oss", interleaved=True, limit=1.5)

# name -> (T, E, K, D, F, options)
CASES = {
    "swiglu": (9, 4, 2, 12, 10, {}),
    "trans_w_false": (7, 3, 2, 8, 6, dict(trans_w=False)),
    "gpt_oss_interleaved": (6, 5, 2, 8, 6, dict(act=GPT_OSS)),
    "expert_with_zero_tokens": (5, 4, 1, 8, 4, dict(ids=[[0], [2], [0], [3], [2]])),
    "all_tokens_on_one_expert": (6, 3, 1, 8, 4, dict(ids=[[1]] * 6)),
    "T=1": (1, 3, 2, 8, 4, {}),
    "k=E_E_not_pow2": (4, 3, 3, 8, 4, {}),
}


def _host(counts):
    return counts.tolist() if isinstance(counts, torch.Tensor) else counts


def _rows(t, index):
    return t if index is None else t.index_select(0, index)


def torch_kernels(watch=None) -> GatherKernels:
    """The kernels' contract in torch ops; watch(name, tensors) sees each call."""
    mm = backends._BACKENDS["loop"]

    def up_act(x, idx, w, counts, prob, trans_w, interleaved, kind, alpha, limit):
        h = mm.mm(_rows(x, idx), w, _host(counts), trans_w)
        return h, act_fwd_eager(h, prob, interleaved, kind, alpha, limit)

    def down_dact(g, idx, w, counts, h, prob, trans_w, interleaved, need_gp, recompute, *act):
        da = mm.mm(_rows(g, idx), w, _host(counts), not trans_w)
        return act_bwd_eager(da, h, prob, interleaved, need_gp, recompute, *act)

    def wgrad(a, b, counts, ia, ib):
        if watch:
            watch("wgrad")
        return mm.wgrad(_rows(a, ia), _rows(b, ib), _host(counts))

    return GatherKernels(up_act, down_dact, wgrad, lambda x, w: True, ("swiglu", "gpt_oss"))


def fused_plan(x, gu, dn, act, trans_w=True, kernels=None, capacity=False):
    """The grouped plan with the four fusable GEMMs on the torch stand-in kernels."""
    plan = plan_expert_mlp(x, gu, dn, act, path="grouped", trans_w=trans_w, capacity=capacity)
    be = plan.backend
    return dataclasses.replace(
        plan, gemms=(None, be, None, None, None, be), kernels=kernels or torch_kernels()
    )


def _operands(T, E, K, D, F, opt, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    ids = torch.rand(T, E, generator=gen).topk(K).indices
    ids = torch.tensor(opt["ids"]) if "ids" in opt else ids
    w_TK = torch.rand(T, K, generator=gen)
    gu = torch.randn(E, 2 * F, D, generator=gen) * 0.4
    dn = torch.randn(E, D, F, generator=gen) * 0.4
    return x, ids, w_TK, gu, dn, torch.randn(T, D, generator=gen)


def _gathered(x, ids, w_TK, gu, dn, act, trans_w=True, kernels=None):
    E = gu.shape[0]
    if not trans_w:
        gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
    sp = sort_by_expert(ids, E)
    prob_S = w_TK.reshape(-1).index_select(0, sp.pair_S)
    plan = fused_plan(x, gu, dn, act, trans_w, kernels)
    return fused_mlp(
        x, prob_S, gu, dn, sp.counts_E, token_S=sp.token_S, slot_TK=sp.slot_TK,
        num_out=x.shape[0], activation=act, trans_w=trans_w, plan=plan,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_gathered_path_matches_the_reference(name):
    T, E, K, D, F, opt = CASES[name]
    x, ids, w_TK, gu, dn, g = _operands(T, E, K, D, F, opt)
    act = opt.get("act", ActivationConfig())
    leaves = [t.clone().requires_grad_(True) for t in (x, w_TK, gu, dn)]
    xl, wl, gul, dnl = leaves
    if opt.get("trans_w", True):
        out = _gathered(xl, ids, wl, gul, dnl, act)
    else:  # the leaves stay in the [E, out, in] layout; the copy is differentiable
        out = _gathered(xl, ids, wl, gul, dnl, act, trans_w=False)
    got = [out, *torch.autograd.grad(out, leaves, g)]
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, w_TK, gu, dn)]
    ref = expert_mlp_reference(ref_leaves[0], ids, *ref_leaves[1:], activation=act)
    want = [ref, *torch.autograd.grad(ref, ref_leaves, g)]
    for what, a, b in zip(["out", "dx", "d weights", "d gate_up", "d down"], got, want):
        # fp32, sums of at most D = 12 products per entry: 1e-5 is ~100 ulps of headroom
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, w=what: f"{w}: {m}")


def _storage_bytes(t):
    return t.untyped_storage().nbytes()


def test_backward_frees_h_and_a_before_the_weight_gradients_that_do_not_read_them(
    monkeypatch,
):
    """h (from the fused "up") is freed once the activation backward has read it, before
    either weight gradient; the recomputed a once the down weight gradient has read it,
    before the gate/up weight gradient and dx. With retain_graph nothing is freed."""
    T, E, K, D, F, opt = CASES["swiglu"]
    x, ids, w_TK, gu, dn, g = _operands(T, E, K, D, F, opt)
    seen, kept = [], {}
    base = torch_kernels()

    def up_act(*args):
        kept["h"], a = base.up_act(*args)
        return kept["h"], a

    def down_dact(*args):
        dh, gp, kept["a"] = base.down_dact(*args)
        return dh, gp, kept["a"]

    def look(name):
        seen.append((name, _storage_bytes(kept["h"]), _storage_bytes(kept["a"])))

    def wgrad(*args):
        look("down_wgrad" if len(seen) % 3 == 0 else "up_wgrad")
        return base.wgrad(*args)

    loop = backends._BACKENDS["loop"]

    def mm(a, b, counts, trans_b, out=None):
        if "a" in kept:  # the backward's one backend GEMM: dx
            look("up_dgrad")
        return loop.mm(a, b, counts, trans_b)

    spy = backends.GemmBackend("test_spy", mm, loop.wgrad, lambda a, b: True, priority=-1)
    monkeypatch.setitem(backends._BACKENDS, "test_spy", spy)
    kernels = dataclasses.replace(base, up_act=up_act, down_dact=down_dact, wgrad=wgrad)
    leaves = [t.clone().requires_grad_(True) for t in (x, w_TK, gu, dn)]
    sp = sort_by_expert(ids, E)
    prob_S = leaves[1].reshape(-1).index_select(0, sp.pair_S)
    plan = fused_plan(x, gu, dn, ActivationConfig(), kernels=kernels)
    plan = dataclasses.replace(plan, gemms=tuple(None if b is None else spy for b in plan.gemms))
    out = fused_mlp(leaves[0], prob_S, leaves[2], leaves[3], sp.counts, token_S=sp.token_S,
                    slot_TK=sp.slot_TK, num_out=T, plan=plan)  # fmt: skip
    out.backward(g, retain_graph=True)
    S = T * K
    assert seen == [
        ("down_wgrad", S * 2 * F * 4, S * F * 4),
        ("up_wgrad", S * 2 * F * 4, S * F * 4),
        ("up_dgrad", S * 2 * F * 4, S * F * 4),
    ], "retain_graph: nothing may be freed"
    seen.clear()
    out.backward(g)
    assert seen == [("down_wgrad", 0, S * F * 4), ("up_wgrad", 0, 0), ("up_dgrad", 0, 0)]


def test_forced_gathered_path_refuses_biases_and_a_cpu_plan_never_picks_it():
    x, ids, w_TK, gu, dn, _ = _operands(*CASES["swiglu"])
    with pytest.raises(ValueError, match="gated experts without biases"):
        plan_expert_mlp(x, gu, dn, ActivationConfig(), path="gathered", bias=True)
    with pytest.raises(ValueError, match="gated experts without biases"):
        sp = sort_by_expert(ids, gu.shape[0])
        fused_mlp(x, None, gu, dn, sp.counts, token_S=sp.token_S, slot_TK=sp.slot_TK,
                  num_out=x.shape[0], down_bias=torch.zeros(4, 12), path="gathered")  # fmt: skip
    with pytest.raises(ValueError, match="gated experts"):
        plan_expert_mlp(x, gu, dn, ActivationConfig("gelu", gated=False), path="gathered")
    for path in (None, "grouped", "gathered"):  # no row-gathering kernel runs on CPU
        plan = plan_expert_mlp(x, gu, dn, ActivationConfig(), path=path)
        assert plan.kernels is None and None not in plan.gemms


def test_gathered_plan_unfused_gemms_follow_the_grouped_backend():
    x, ids, w_TK, gu, dn, _ = _operands(*CASES["swiglu"])
    plan = plan_expert_mlp(x, gu, dn, ActivationConfig(), path="gathered")
    grouped = plan_expert_mlp(x, gu, dn, ActivationConfig(), path="grouped")
    assert plan.gemms == grouped.gemms and plan.backend.name == grouped.backend.name


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])  # row-op and torch activation backward
def test_grouped_path_frees_h_before_its_weight_gradients(monkeypatch, kind):
    """The grouped path's h is freed by its last reader, the activation backward, so it
    is gone when the weight-gradient GEMMs run (a spy backend checks at each call); with
    retain_graph it is kept."""
    from dropless.ops.grouped_gemm.backends import GemmBackend

    loop, kept, at_wgrad = backends._BACKENDS["loop"], [], []

    def mm(a, b, counts, trans_b, out=None):
        y = loop.mm(a, b, counts, trans_b)
        kept.append(y)  # the first one of a forward is h
        return y

    def wgrad(a, b, counts):
        at_wgrad.append(_storage_bytes(kept[0]))
        return loop.wgrad(a, b, counts)

    spy = GemmBackend("test_spy", mm, wgrad, supports=lambda a, b: True, priority=-1)
    monkeypatch.setitem(backends._BACKENDS, "test_spy", spy)
    T, E, K, D, F, opt = CASES["swiglu"]
    x, ids, w_TK, gu, dn, g = _operands(T, E, K, D, F, opt)
    leaves = [t.clone().requires_grad_(True) for t in (x, w_TK, gu, dn)]
    sp = sort_by_expert(ids, E)
    prob_S = leaves[1].reshape(-1).index_select(0, sp.pair_S)
    out = fused_mlp(
        leaves[0], prob_S, leaves[2], leaves[3], sp.counts, token_S=sp.token_S,
        slot_TK=sp.slot_TK, num_out=T, activation=kind, path="grouped", backend="test_spy",
    )  # fmt: skip
    out.backward(g, retain_graph=True)
    assert at_wgrad == [T * K * 2 * F * 4] * 2
    at_wgrad.clear()
    out.backward(g)
    assert at_wgrad == [0, 0]


def test_gathered_path_with_dropped_pairs_matches_the_grouped_path():
    """Capacity mode: dropped pairs have no sorted row (their slot is past the end); the
    gathered path's combine reads them as zero, as the grouped path's does."""
    T, E, K, D, F, opt = CASES["swiglu"]
    x, ids, w_TK, gu, dn, g = _operands(T, E, K, D, F, opt)
    keep = torch.rand(T, K, generator=torch.Generator().manual_seed(3)) > 0.4
    sp = sort_by_expert(ids, E, keep)
    assert sp.num_slots < T * K
    results = []
    for path in ("gathered", "grouped"):
        leaves = [t.clone().requires_grad_(True) for t in (x, w_TK, gu, dn)]
        prob_S = leaves[1].reshape(-1).index_select(0, sp.pair_S)
        plan = plan_expert_mlp(x, gu, dn, ActivationConfig(), path="grouped", capacity=True)
        if path == "gathered":
            plan = fused_plan(x, gu, dn, ActivationConfig(), capacity=True)
        out = fused_mlp(
            leaves[0], prob_S, leaves[2], leaves[3], sp.counts, token_S=sp.token_S,
            slot_TK=sp.slot_TK, num_out=T, plan=plan,
        )  # fmt: skip
        results.append([out, *torch.autograd.grad(out, leaves, g)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_prob", [True, False])
def test_gathered_path_on_sorted_rows_matches_the_grouped_path(with_prob):
    """grouped_mlp's form (rows already sorted, no token index, no combine), with and
    without a routing weight."""
    counts, D, F, E = [5, 0, 9, 3], 12, 10, 4
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(counts), D, generator=gen)
    p = torch.rand(sum(counts), generator=gen) if with_prob else None
    gu, dn = torch.randn(E, 2 * F, D, generator=gen), torch.randn(E, D, F, generator=gen)
    g = torch.randn(sum(counts), D, generator=gen)
    results = []
    for path in ("gathered", "grouped"):
        leaves = [t.clone().requires_grad_(True) for t in (x, gu, dn)]
        prob = p.clone().requires_grad_(True) if with_prob else None
        plan = plan_expert_mlp(x, gu, dn, ActivationConfig(), path="grouped")
        if path == "gathered":
            plan = fused_plan(x, gu, dn, ActivationConfig())
        out = fused_mlp(leaves[0], prob, leaves[1], leaves[2], counts, plan=plan)
        ins = leaves + ([prob] if with_prob else [])
        results.append([out, *torch.autograd.grad(out, ins, g)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
