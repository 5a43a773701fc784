"""The low-rank (LoRA) path of the fused expert MLP against its definition (the plain
MLP on weights with the update folded in, `lowrank_fold_reference`), forward and
backward, on both implementations; the base weights get no gradient."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, R rank

import pytest
import torch
from test_fused_mlp import CASES, _problem

from dropless import ops
from dropless.ops import LowRank
from dropless.ops.expert_mlp import composed_mlp
from dropless.ops.expert_mlp.eager import run as fused_mlp
from dropless.ops.reference import lowrank_fold_reference

R = 3


def _factors(E, n_in, n_out, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(E, R, n_in, generator=g, dtype=dtype) * 0.5
    b = torch.randn(E, n_out, R, generator=g, dtype=dtype) * 0.5
    return a, b


def _lora_problem(which, dtype=torch.float32, **c):
    x, ids_TK, w_TK, gu, dn, gb, db = _problem(dtype=dtype, **c)
    E, trans_w = gu.shape[0], c.get("trans_w", True)
    n1 = gu.shape[1] if trans_w else gu.shape[2]
    D = x.shape[1]
    F = dn.shape[2] if trans_w else dn.shape[1]
    a1, b1 = _factors(E, D, n1, dtype, 10) if which in ("both", "gate_up") else (None, None)
    a2, b2 = _factors(E, F, D, dtype, 11) if which in ("both", "down") else (None, None)
    return (x, ids_TK, w_TK, gu, dn, gb, db), (a1, b1, a2, b2)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in ts]


def _backward(out, leaves, seed=1):
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    out.backward(go)
    return [out.detach()] + [t.grad if t is not None else None for t in leaves]


def _reference(ids_TK, keep_TK, kw, base, ab, s1=2.0, s2=0.5):
    """The plain composed MLP on folded weights (autograd through the fold)."""
    x, w_TK, gu, dn, gb, db = base
    a1, b1, a2, b2 = ab
    trans_w = kw["trans_w"]
    gu_f = lowrank_fold_reference(gu, a1, b1, s1, trans_w) if a1 is not None else gu
    dn_f = lowrank_fold_reference(dn, a2, b2, s2, trans_w) if a2 is not None else dn
    sp = ops.sort_by_expert(ids_TK, gu.shape[0], keep_TK)
    prob_S = w_TK.reshape(-1).index_select(0, sp.pair_S)
    y = composed_mlp(
        ops.permute(x, sp), sp.counts, prob_S, gu_f, dn_f, gate_up_bias=gb, down_bias=db,
        alpha=1.702, limit=7.0, backend="loop", **kw,
    )  # fmt: skip
    return ops.unpermute(y, sp)


def _fast(ids_TK, keep_TK, kw, base, ab, backend, s1=2.0, s2=0.5):
    x, w_TK, gu, dn, gb, db = base
    a1, b1, a2, b2 = ab
    lora = (
        LowRank(a1, b1, s1) if a1 is not None else None,
        LowRank(a2, b2, s2) if a2 is not None else None,
    )
    return ops.expert_mlp(
        x, ids_TK, w_TK, gu, dn, keep_TK=keep_TK, gate_up_bias=gb, down_bias=db,
        backend=backend, lora=lora, **kw,
    )[0]  # fmt: skip


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("case", list(CASES))
def test_lowrank_matches_folded_fp32(case, backend):
    c = dict(CASES[case])
    kw = dict(
        activation=c.pop("activation", "swiglu"),
        interleaved=c.pop("interleaved", False),
        trans_w=c.get("trans_w", True),
    )
    capacity = c.pop("capacity", False)
    (x, ids_TK, w_TK, gu, dn, gb, db), ab = _lora_problem("both", **c)
    keep_TK = (
        torch.rand(ids_TK.shape, generator=torch.Generator().manual_seed(5)) > 0.4
        if capacity
        else None
    )
    results = []
    for fn in (_reference, lambda *a: _fast(*a, backend)):
        base = _leaves(x, w_TK, gu, dn, gb, db)
        base[2].requires_grad_(False)  # frozen base weights, as under LoRA
        base[3].requires_grad_(False)
        lo = _leaves(*ab)
        out = fn(ids_TK, keep_TK, kw, base, lo)
        results.append(_backward(out, [base[0], base[1], *lo]))
    names = ["out", "x", "weights", "gate_up_A", "gate_up_B", "down_A", "down_B"]
    for name, got, want in zip(names, results[1], results[0]):
        # folded and factored products round differently: tolerance relative to the scale
        atol = 1e-5 * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=f"{case}/{backend}: {name}")


@pytest.mark.parametrize(
    "path, which",
    [("loop", "both"), ("loop", "gate_up"), ("loop", "down"), ("grouped", "both")],
)
def test_lowrank_gradcheck_fp64(path, which):
    (x, ids_TK, w_TK, gu, dn, gb, db), ab = _lora_problem(
        which, dtype=torch.float64, T=3, K=2, E=3, D=3, F=2, bias=True
    )
    sp = ops.sort_by_expert(ids_TK, 3)
    present = [t for t in ab if t is not None]

    def fn(x, w_TK, gb, *factors):
        it = iter(factors)
        a1, b1 = (next(it), next(it)) if ab[0] is not None else (None, None)
        a2, b2 = (next(it), next(it)) if ab[2] is not None else (None, None)
        lora = (
            LowRank(a1, b1, 1.5) if a1 is not None else None,
            LowRank(a2, b2, 0.7) if a2 is not None else None,
        )
        prob_S = w_TK.reshape(-1).index_select(0, sp.pair_S)
        return fused_mlp(
            x, prob_S, gu, dn, sp.counts, token_S=sp.token_S, slot_TK=sp.slot_TK, num_out=3,
            gate_up_bias=gb, down_bias=db, activation="gpt_oss", limit=1.0, path=path, lora=lora,
        )  # fmt: skip

    leaves = [t.requires_grad_(True) for t in (x, w_TK, gb, *present)]
    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("path", ["loop", "grouped"])
def test_lowrank_with_trainable_base_fp64(path):
    """Base weights that do need a gradient get the same one as without the update."""
    (x, ids_TK, w_TK, gu, dn, _, _), (a1, b1, a2, b2) = _lora_problem(
        "both", dtype=torch.float64, T=5, K=2, E=3
    )
    sp = ops.sort_by_expert(ids_TK, 3)
    prob_S = w_TK.reshape(-1).index_select(0, sp.pair_S)
    grads = []
    for fold in (True, False):
        g, d = _leaves(gu, dn)
        lora = (LowRank(a1, b1, 2.0), LowRank(a2, b2, 0.5))
        if fold:
            gf, df = lowrank_fold_reference(g, a1, b1, 2.0), lowrank_fold_reference(d, a2, b2, 0.5)
            lora = None
        else:
            gf, df = g, d
        out = fused_mlp(
            x, prob_S, gf, df, sp.counts, token_S=sp.token_S, slot_TK=sp.slot_TK, num_out=5,
            path=path, lora=lora,
        )  # fmt: skip
        out.sum().backward()
        grads.append((out.detach(), g.grad, d.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_lowrank_bad_shapes_raise():
    (x, ids_TK, w_TK, gu, dn, _, _), (a1, b1, _, _) = _lora_problem("gate_up")
    with pytest.raises(ValueError, match="low-rank factors of down"):
        ops.expert_mlp(x, ids_TK, w_TK, gu, dn, lora=(None, LowRank(a1, b1, 1.0)))
    with pytest.raises(ValueError, match="same E and r"):
        LowRank(a1, b1[:, :, :2], 1.0)
    with pytest.raises(TypeError, match="pair"):
        ops.expert_mlp(x, ids_TK, w_TK, gu, dn, lora=LowRank(a1, b1, 1.0))


def test_lowrank_refused_under_a_low_precision_recipe():
    (x, ids_TK, w_TK, gu, dn, _, _), (a1, b1, _, _) = _lora_problem("gate_up")

    class Recipe:
        kind = "mxfp8"

    token = ops.set_recipe(Recipe())
    try:
        with pytest.raises(ValueError, match="full precision only"):
            ops.expert_mlp(x, ids_TK, w_TK, gu, dn, lora=(LowRank(a1, b1, 1.0), None))
    finally:
        ops.reset_recipe(token)
