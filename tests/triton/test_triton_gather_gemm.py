"""The row-gathering grouped GEMMs (ops/expert_mlp/gather_gemm_kernels.py) against torch math in
fp32, raw and as the six GEMMs of the "gathered" expert path against the reference MLP
(forward, dx, d gate_up, d down, d routing weights).

`check(case, device)` runs under TRITON_INTERPRET=1 in a child process (tests/interpreted.py).
Interpreter tiles are 16 rows (8 for a tail), 16 columns, 16 deep and 3 persistent
programs, so these shapes span several tiles, partial ones, short tails and more tiles
than programs. The TMA cases run the descriptor path under the interpreter (its indexing,
not the hardware: on a GPU it is unverified). bf16 numerics are a GPU check (test_cuda;
the interpreter's bf16 tl.dot is not trustworthy).
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

from __future__ import annotations

import dataclasses

import torch

from interpreted import interpreted_tests

# raw: (rows per expert, T, D, F, options)
RAW = {
    "raw_basic": ([5, 3, 9, 4], 11, 20, 12, {}),
    "raw_expert_with_zero_rows": ([5, 0, 17, 3], 13, 20, 18, dict(trans_w=False)),
    "raw_all_rows_on_one_expert": ([0, 0, 25, 0], 25, 24, 12, {}),
    "raw_single_row": ([0, 1, 0], 1, 8, 4, {}),
    "raw_E_not_pow2_gpt_oss_interleaved": (
        [2, 7, 1, 0, 6],
        9,
        20,
        10,
        dict(kind="gpt_oss", il=True),
    ),
    "raw_tma": ([5, 0, 17, 3], 13, 24, 20, dict(tma=True)),
    "raw_tma_trans_w_false": ([6, 11, 2], 9, 16, 12, dict(tma=True, trans_w=False)),
    "raw_sorted_rows_no_prob": ([4, 9, 3], 16, 20, 12, dict(no_index=True, no_prob=True)),
}
# the MLP: (T, E, K, D, F, token ids or None)
MLP = {
    "mlp_basic": (9, 4, 2, 20, 12, None),
    "mlp_expert_with_zero_tokens": (5, 4, 1, 12, 8, [[0], [2], [0], [3], [2]]),
    "mlp_all_tokens_on_one_expert": (19, 3, 1, 12, 8, [[1]] * 19),
    "mlp_T=1": (1, 3, 2, 8, 4, None),
    "mlp_k=E_E_not_pow2": (5, 3, 3, 12, 8, None),
}
CASES = {**{n: ("raw", c) for n, c in RAW.items()}, **{n: ("mlp", c) for n, c in MLP.items()}}
CASES["kinds_match_the_device_functions"] = ("kinds", None)
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, sums of at most 24 products per entry


def _offsets(counts):
    off = [0]
    for c in counts:
        off.append(off[-1] + c)
    return off


def _per_expert(a, w, counts, trans):
    """Rows of expert e times w[e]^T (trans) or w[e]."""
    off = _offsets(counts)
    parts = [a[off[e] : off[e + 1]] @ (w[e].t() if trans else w[e]) for e in range(len(counts))]
    return torch.cat(parts)


def _raw(case, device):
    from dropless.ops.expert_mlp import gather_gemm_kernels as gk

    counts, T, D, F, opt = case
    E, S = len(counts), sum(counts)
    gen = torch.Generator().manual_seed(S + D + F)
    x = torch.randn(T if not opt.get("no_index") else S, D, generator=gen)
    idx = None if opt.get("no_index") else torch.randint(0, T, (S,), generator=gen)
    gu = torch.randn(E, 2 * F, D, generator=gen) * 0.3
    dn = torch.randn(E, D, F, generator=gen) * 0.3
    p = None if opt.get("no_prob") else torch.rand(S, generator=gen)
    g = torch.randn(x.shape, generator=gen)
    trans, kind, il = opt.get("trans_w", True), opt.get("kind", "swiglu"), opt.get("il", False)
    guw = gu if trans else gu.transpose(1, 2).contiguous()
    dnw = dn if trans else dn.transpose(1, 2).contiguous()
    dev = [t.to(device) if t is not None else None for t in (x, idx, guw, dnw, p, g)]
    use_tma = gk._use_tma
    if opt.get("tma"):  # the descriptor path, also on CPU (the interpreter runs it)
        gk._use_tma = lambda w, interleaved: True
    try:
        _raw_checks(gk, counts, dev, x, idx, g, gu, dn, p, trans, kind, il)
    finally:
        gk._use_tma = use_tma


def _raw_checks(gk, counts, dev, x, idx, g, gu, dn, p, trans, kind, il):
    from dropless.ops.activation.eager import act_bwd_eager, act_fwd_eager

    E, device = len(counts), dev[0].device
    act = dict(interleaved=il, activation=kind, alpha=1.702, limit=1.5)
    cnt = torch.tensor(counts, device=device)
    h, a = gk.up_act(dev[0], dev[1], dev[2], cnt, dev[4], trans, **act)
    dh, gp, a2 = gk.down_dact(
        dev[5], dev[1], dev[3], cnt, h, dev[4], trans, need_prob_grad=True, recompute=True, **act
    )
    xs, gs = (x, g) if idx is None else (x[idx], g[idx])
    h_ref = _per_expert(xs, gu, counts, True)
    a_ref = act_fwd_eager(h_ref, p, **act)
    dh_ref, gp_ref, a2_ref = act_bwd_eager(
        _per_expert(gs, dn, counts, False), h_ref, p, il, True, True, kind, limit=1.5
    )
    for name, got, want in [("h", h, h_ref), ("a", a, a_ref), ("dh", dh, dh_ref),
                            ("d prob", gp, gp_ref), ("recomputed a", a2, a2_ref)]:  # fmt: skip
        if want is None:  # no prob: no prob gradient
            assert got is None, name
            continue
        torch.testing.assert_close(got.cpu(), want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    off = _offsets(counts)
    blocks = [(gs[off[e] : off[e + 1]].t() @ a_ref[off[e] : off[e + 1]]) for e in range(E)]
    gd = gk.gathered_wgrad(dev[5], a, cnt, index_a=dev[1])
    torch.testing.assert_close(gd.cpu(), torch.stack(blocks), **TOL)
    blocks = [(dh_ref[off[e] : off[e + 1]].t() @ xs[off[e] : off[e + 1]]) for e in range(E)]
    ggu = gk.gathered_wgrad(dh, dev[0], counts, index_b=dev[1])  # host counts too
    torch.testing.assert_close(ggu.cpu(), torch.stack(blocks), **TOL)


def _all_fused(plan):
    """The grouped plan with every fusable GEMM on the row-gathering kernels (without
    tuning; the registry offers the kernels for CUDA tensors only: here for any)."""
    from dropless.ops.expert_mlp.plan import FUSABLE, GEMMS, triton_gather_kernels

    kernels = dataclasses.replace(triton_gather_kernels(), supports=lambda x, w: True)
    gemms = tuple(None if g in FUSABLE else plan.gemm(g) for g in GEMMS)
    return dataclasses.replace(plan, gemms=gemms, kernels=kernels, device_counts=True)


def _mlp(case, device):
    from dropless.ops import sort_by_expert
    from dropless.ops.expert_mlp.eager import run as fused_mlp
    from dropless.ops.expert_mlp.plan import plan_expert_mlp
    from dropless.ops.reference import expert_mlp_reference
    from dropless.ops.specs import ActivationConfig

    T, E, K, D, F, ids = case
    gen = torch.Generator().manual_seed(T * 10 + E)
    x = torch.randn(T, D, generator=gen)
    ids = torch.tensor(ids) if ids is not None else torch.rand(T, E, generator=gen).topk(K).indices
    w_TK = torch.rand(T, K, generator=gen)
    gu = torch.randn(E, 2 * F, D, generator=gen) * 0.4
    dn = torch.randn(E, D, F, generator=gen) * 0.4
    g = torch.randn(T, D, generator=gen)
    leaves = [t.to(device).requires_grad_(True) for t in (x, w_TK, gu, dn)]
    act = ActivationConfig()
    plan = _all_fused(plan_expert_mlp(leaves[0], gu, dn, act, path="grouped"))
    sp = sort_by_expert(ids.to(device), E)
    prob_S = leaves[1].reshape(-1).index_select(0, sp.pair_S)
    out = fused_mlp(
        leaves[0], prob_S, leaves[2], leaves[3], sp.counts_E, token_S=sp.token_S,
        slot_TK=sp.slot_TK, num_out=T, activation=act, plan=plan,
    )  # fmt: skip
    got = [out, *torch.autograd.grad(out, leaves, g.to(device))]
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, w_TK, gu, dn)]
    ref = expert_mlp_reference(ref_leaves[0], ids, *ref_leaves[1:])
    want = [ref, *torch.autograd.grad(ref, ref_leaves, g)]
    for name, a, b in zip(["out", "dx", "d weights", "d gate_up", "d down"], got, want):
        torch.testing.assert_close(a.detach().cpu(), b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def check(case, device: str) -> None:
    what, c = case
    if what == "raw":
        return _raw(c, device)
    if what == "mlp":
        return _mlp(c, device)
    from dropless.ops.activation import activation_kernels as activations
    from dropless.ops.expert_mlp.plan import triton_gather_kernels

    assert triton_gather_kernels().kinds == activations.KINDS


test_interpreted, test_cuda = interpreted_tests(CASES, check)
