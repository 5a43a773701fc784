"""Expert activations beyond SwiGLU (GELU exact/tanh, ReLU^2, clamped SwiGLU, registered
elementwise functions, non-gated experts): the fused expert MLP (both paths) and the
`swiglu` op against the reference, forward and backward, in float64."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dropless import ops
from dropless.ops import ActivationConfig
from dropless.ops.activation import eager as A
from dropless.ops.activation.eager import REGISTERED, register_elementwise
from dropless.ops.expert_mlp.eager import run as fused_mlp
from dropless.ops.reference import activation_reference, expert_mlp_reference

if "test_softsign" not in REGISTERED:
    register_elementwise("test_softsign", F.softsign, "softsign(gate) * up")

ACTS = [
    ActivationConfig("gelu"),
    ActivationConfig("gelu_tanh", interleaved=True),
    ActivationConfig("relu2"),
    ActivationConfig("swiglu_clamp", limit=0.8),
    ActivationConfig("test_softsign"),
    ActivationConfig("relu2", gated=False),
    ActivationConfig("gelu", gated=False),
    ActivationConfig("swiglu", gated=False),
    ActivationConfig("test_softsign", gated=False),
]
ROUTINGS = ["random", "expert 0 empty", "all on expert 0", "T=1", "k=E"]


def _problem(act, routing, E=3, D=6, F=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, K = (1, 2) if routing == "T=1" else (5, E if routing == "k=E" else 2)
    if routing == "expert 0 empty":
        ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] + 1 for _ in range(T)])
    elif routing == "all on expert 0":
        ids = torch.stack(
            [torch.tensor([0, int(torch.randint(1, E, (1,), generator=g))]) for _ in range(T)]
        )
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    N = 2 * F if act.gated else F
    dt = torch.float64
    x = torch.randn(T, D, generator=g, dtype=dt)
    w = torch.rand(T, K, generator=g, dtype=dt) + 0.1
    gu = torch.randn(E, N, D, generator=g, dtype=dt)
    dn = torch.randn(E, D, F, generator=g, dtype=dt)
    return x, ids, w, gu, dn


def _grads(fn, *tensors):
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    out.backward(
        torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    )
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("act", ACTS, ids=lambda a: f"{a.kind}{'' if a.gated else '-nongated'}")
def test_fused_expert_mlp_matches_reference(act, routing):
    x, ids, w, gu, dn = _problem(act, routing)
    want = _grads(
        lambda x, w, gu, dn: expert_mlp_reference(x, ids, w, gu, dn, activation=act), x, w, gu, dn
    )
    sp = ops.sort_by_expert(ids, gu.shape[0])

    def fused(path):
        def run(x, w, gu, dn):
            prob_S = w.reshape(-1).index_select(0, sp.pair_S)
            return fused_mlp(
                x, prob_S, gu, dn, sp.counts, token_S=sp.token_S, slot_TK=sp.slot_TK,
                num_out=x.shape[0], activation=act, path=path,
            )  # fmt: skip

        return run

    for path in ("loop", "grouped"):  # float64: the grouped path runs the loop GEMM backend
        got = _grads(fused(path), x, w, gu, dn)
        for name, a, b in zip(["out", "x", "w", "gate_up", "down"], got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"{path} {name}")
    got = _grads(lambda *t: ops.expert_mlp(t[0], ids, *t[1:], activation=act)[0], x, w, gu, dn)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("act", ACTS, ids=lambda a: f"{a.kind}{'' if a.gated else '-nongated'}")
def test_activation_op_gradcheck(act):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 8, generator=g, dtype=torch.float64) * 1.5
    p = torch.rand(4, generator=g, dtype=torch.float64)
    got = ops.swiglu(h, p, activation=act)
    fn = REGISTERED.get(act.kind)
    kw = dict(gated=act.gated, interleaved=act.interleaved, alpha=act.alpha, limit=act.limit)
    want = activation_reference(h, act.kind, fn=fn, **kw) * p[:, None]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    args = (h.clone().requires_grad_(True), p.clone().requires_grad_(True))
    assert torch.autograd.gradcheck(lambda h, p: ops.swiglu(h, p, activation=act), args)


def test_bad_activation_kinds():
    with pytest.raises(ValueError, match="gated=True"):
        ops.swiglu(torch.randn(2, 4), activation=ActivationConfig("swiglu_clamp", gated=False))
    with pytest.raises(ValueError, match="new non-empty name"):
        register_elementwise("gelu", F.gelu, "again")
    with pytest.raises(TypeError, match="callable"):
        register_elementwise("test_not_callable", 3, "x")


MODULE_ACTS = [
    *ACTS,
    ActivationConfig("swiglu"),
    ActivationConfig("swiglu", interleaved=True),
    ActivationConfig("gpt_oss", limit=0.8),
    ActivationConfig("gpt_oss", interleaved=True, alpha=1.3, limit=1.1),
]


@pytest.mark.parametrize("act", MODULE_ACTS, ids=lambda a: f"{a.kind}-{a.gated}-{a.interleaved}")
@pytest.mark.parametrize("buffers", [False, True], ids=["alloc", "into_buffers"])
def test_the_activation_module_matches_the_reference(act, buffers):
    """forward, recomputed parts and input gradient of `ops.activation.eager` (the one torch
    home of the math) against autograd through the reference, in float64; the buffer
    forms (the loop's in-place path) give the same values."""
    g = torch.Generator().manual_seed(2)
    n, F_ = 5, 4
    h = torch.randn(n, 2 * F_ if act.gated else F_, generator=g, dtype=torch.float64) * 1.5
    p = torch.rand(n, generator=g, dtype=torch.float64)
    gy = torch.randn(n, F_, generator=g, dtype=torch.float64)
    fn = REGISTERED.get(act.kind)
    kw = dict(gated=act.gated, interleaved=act.interleaved, alpha=act.alpha, limit=act.limit)
    hr, pr = h.clone().requires_grad_(True), p.clone().requires_grad_(True)
    want = activation_reference(hr, act.kind, fn=fn, **kw) * pr[:, None]
    want_h, want_p = torch.autograd.grad(want, (hr, pr), gy)
    bufs = [h.new_empty(n, F_) for _ in range(4)] if buffers else None
    out = h.new_empty(n, F_) if buffers else None
    h0 = h.clone()
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(A.act_forward(h, p, act, out=out), want.detach(), **tol)
    a0, d_gate, d_up = A.act_parts(h, act, bufs)
    torch.testing.assert_close(a0 * p[:, None], want.detach(), **tol)
    dh = A.act_input_grad(gy * p[:, None], d_gate, d_up, act.interleaved, torch.empty_like(h))
    torch.testing.assert_close(dh, want_h, **tol)
    dh2, dp, a = A.act_backward(gy, h, p, act, recompute=True)
    torch.testing.assert_close((dh2, dp, a), (want_h, want_p, want.detach()), **tol)
    assert torch.equal(h, h0), "the activation math must not write into h"


SRC = Path(__file__).resolve().parents[2] / "src" / "dropless"


def test_no_other_torch_file_writes_an_activation_derivative():
    """One home for the math: outside `ops/activations.py` (and the reference, which
    derives by autograd) no torch file of ops, nn or quant computes a sigmoid of a gate."""
    pattern = re.compile(r"sigmoid\((gate|g\b|g \*|gate \*)|sigmoid_\(\)\.mul_\(g\)")
    allowed = {SRC / "ops" / "activations.py", SRC / "ops" / "reference.py"}
    offenders = [
        f"{path.relative_to(SRC)}:{i}"
        for folder in ("ops", "nn", "quant")
        for path in sorted((SRC / folder).glob("*.py"))
        if path not in allowed and not path.name.startswith("triton")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == [], offenders
