"""The `dropless::expert_mlp` custom op (what torch.compile and torch.export see of the
routed expert MLP) against the pure-torch definition, forward and backward, at the edge
cases of the routing; and its registration checked by `torch.library.opcheck` (schema,
fake rule, autograd)."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

import pytest
import torch

from dropless.ops.expert_mlp import eager
from dropless.ops.expert_mlp.plan import plan_expert_mlp
from dropless.ops.reference import activation_reference
from dropless.ops.specs import ActivationConfig

SWIGLU = ActivationConfig("swiglu", True, False, 1.702, 7.0)
GPT_OSS = ActivationConfig("gpt_oss", True, True, 1.702, 1.5)
GELU = ActivationConfig("gelu", False, False, 1.702, 7.0)


def _reference(x_TD, ids_TK, w_TK, gate_up, down, b1, b2, act, trans_w):
    """The routed MLP by its definition: each token through each of its experts."""
    T, K = ids_TK.shape
    rows = []
    for t in range(T):
        acc = x_TD.new_zeros(down.shape[1] if trans_w else down.shape[2])
        for k in range(K):
            e = int(ids_TK[t, k])
            w1, w2 = (gate_up[e], down[e]) if trans_w else (gate_up[e].T, down[e].T)
            h = w1 @ x_TD[t] + (0 if b1 is None else b1[e])
            a = activation_reference(h[None], act.kind, gated=act.gated, interleaved=act.interleaved,
                                     alpha=act.alpha, limit=act.limit)[0]  # fmt: skip
            acc = acc + w_TK[t, k] * (w2 @ a + (0 if b2 is None else b2[e]))
        rows.append(acc)
    return torch.stack(rows)


def _operands(T, D, F, E, K, act, bias, trans_w, ids_TK=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = 2 * F if act.gated else F
    shapes = ((E, N, D), (E, D, F)) if trans_w else ((E, D, N), (E, F, D))
    x = torch.randn(T, D, generator=g)
    if ids_TK is None:
        ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w_TK = torch.rand(T, K, generator=g)
    gate_up = torch.randn(*shapes[0], generator=g) * 0.3
    down = torch.randn(*shapes[1], generator=g) * 0.3
    b1 = torch.randn(E, N, generator=g) if bias else None
    b2 = torch.randn(E, D, generator=g) if bias else None
    return x, ids_TK, w_TK, gate_up, down, b1, b2


CASES = {
    "plain": dict(T=7, E=4, K=2),
    "expert_without_tokens": dict(T=5, E=4, K=1, ids=[[0], [1], [0], [2], [1]]),
    "all_on_one_expert": dict(T=6, E=4, K=1, ids=[[3]] * 6),
    "one_token": dict(T=1, E=4, K=2),
    "k_equals_e": dict(T=4, E=3, K=3),
    "e_not_a_power_of_two": dict(T=9, E=5, K=2),
}


@pytest.fixture(params=["loop", "grouped"])
def path(request, monkeypatch):
    """The node runs eager's schedule for the device (CPU: the loop); both are checked here."""

    def op_plan(x, gate_up, down, act, trans_w):
        return plan_expert_mlp(x, gate_up, down, act, path=request.param, trans_w=trans_w)

    monkeypatch.setattr(eager, "_op_plan", op_plan)
    return request.param


def _run(x, ids, w, gate_up, down, b1, b2, act, trans_w):
    """(out, pair_S, slot_TK, counts_E) of the op."""
    out, _h, pair_S, slot_TK, counts_E = eager.expert_mlp_op(
        x, ids, w.to(x.dtype), gate_up, down, b1, b2, act.kind, act.gated, act.interleaved,
        float(act.alpha), float(act.limit), trans_w, True,
    )  # fmt: skip
    return out, pair_S, slot_TK, counts_E


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "act, bias, trans_w",
    [(SWIGLU, False, True), (GPT_OSS, True, False), (GELU, True, True)],
    ids=["swiglu", "gpt_oss_bias_untransposed", "gelu_bias"],
)
def test_custom_op_matches_the_definition(case, act, bias, trans_w, path):
    c = CASES[case]
    ids = None if "ids" not in c else torch.tensor(c["ids"])
    ops = _operands(c["T"], 8, 6, c["E"], c["K"], act, bias, trans_w, ids)
    mine = [t.clone().requires_grad_(True) if t is not None and t.is_floating_point() else t
            for t in ops]  # fmt: skip
    ref = [t.clone().requires_grad_(True) if t is not None and t.is_floating_point() else t
           for t in ops]  # fmt: skip
    out, pair_S, slot_TK, counts_E = _run(*mine, act, trans_w)
    want = _reference(*ref, act, trans_w)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    ids_TK = ops[1]
    assert counts_E.tolist() == torch.bincount(ids_TK.flatten(), minlength=c["E"]).tolist()
    assert sorted(pair_S.tolist()) == list(range(ids_TK.numel()))  # every pair, once
    sorted_ids = ids_TK.flatten()[pair_S]
    assert bool((sorted_ids[1:] >= sorted_ids[:-1]).all()), "pairs sorted by expert"
    assert (pair_S[slot_TK.flatten()] == torch.arange(ids_TK.numel())).all()
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (want * g).sum().backward()
    for a, b in zip(mine, ref):
        if a is not None and a.is_floating_point():
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_opcheck_schema_fake_and_autograd(path):
    """torch.library.opcheck: the schema matches what the op does, the fake rule gives
    the real outputs' shapes, and the autograd registration is consistent."""
    x, ids, w, gate_up, down, b1, b2 = _operands(6, 8, 6, 5, 2, SWIGLU, True, True)
    args = (x.requires_grad_(), ids, w.requires_grad_(), gate_up.requires_grad_(),
            down.requires_grad_(), b1.requires_grad_(), b2.requires_grad_(),
            "swiglu", True, False, 1.702, 7.0, True, True)  # fmt: skip
    torch.library.opcheck(eager.expert_mlp_op, args)


def test_a_call_that_records_no_backward_keeps_no_h(path):
    """keep_h=False (what `ops.expert_mlp` passes under no_grad or without a tensor that
    requires grad): the same output, h empty (a fresh [S, N] tensor per call is the
    custom op's cost at many tokens); the fake rule says the same shapes (opcheck)."""
    x, ids, w, gate_up, down, b1, b2 = _operands(7, 8, 6, 5, 2, SWIGLU, True, True)
    args = (x, ids, w, gate_up, down, b1, b2, "swiglu", True, False, 1.702, 7.0, True)
    out, h, *indices = eager.expert_mlp_op(*args, True)
    out_no_h, h_none, *indices_no_h = eager.expert_mlp_op(*args, False)
    assert h.shape == (14, 12) and h_none.shape == (0, 12)
    torch.testing.assert_close(out_no_h, out, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(indices, indices_no_h))
    torch.library.opcheck(eager.expert_mlp_op, (*args, False))
    assert not eager._needs_grad(x, w, gate_up, down, b1)
    with torch.no_grad():
        assert not eager._needs_grad(x, w, gate_up.requires_grad_(), down)
    assert eager._needs_grad(x, w, gate_up, down)
