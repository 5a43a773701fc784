"""The ops besides the expert MLP as `torch.library` custom ops: what `torch.compile` and
`torch.export` see of them (RMSNorm, linear cross-entropy, the grouped GEMM, routing). For each: opcheck (schema,
fake rule, autograd registration), a compiled call equal to eager with no graph break and
the op as one node, the implementation picked when the node runs (not when it is traced),
and an exported program holding the node."""

# R rows, D model dim, V vocab

import pytest
import torch

from dropless.nn import GroupedLinear
from dropless.ops.grouped_gemm import custom_op as gemm_op
from dropless.ops.linear_cross_entropy import custom_op as ce_op
from dropless.ops.linear_cross_entropy import linear_cross_entropy
from dropless.ops.linear_cross_entropy.rows import CE_ROWS, EAGER_CE_ROWS, CERows
from dropless.ops.losses import mean_normalised_scores
from dropless.ops.rmsnorm import RMSNORM, RMSNormImpl, rms_norm
from dropless.ops.rmsnorm import custom_op as rms_op
from dropless.ops.rmsnorm.eager import rms_norm_fwd
from dropless.ops.routing import ROUTING, RoutingKernels, route, route_with_aux
from dropless.ops.routing import custom_op as route_op
from dropless.ops.routing.reference import route_reference
from dropless.ops.specs import RoutingConfig


def _graph_ops(fn, *args) -> tuple[list[str], object]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    return [str(n.target) for g in explained.graphs for n in g.graph.nodes], explained


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_opcheck(residual, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 12, generator=g).to(dtype).requires_grad_()
    w = torch.randn(12, generator=g).to(dtype).requires_grad_()
    r = torch.randn(7, 12, generator=g).to(dtype).requires_grad_() if residual else None
    torch.library.opcheck(rms_op.rms_norm_op, (x, w, r, 1e-5))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_compiles_equal_to_eager(residual):
    """On CPU a compiled region traces the one Function on the torch passes (the compiler
    fuses them; no opaque node), forward and backward equal to eager."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    w = torch.randn(16, generator=g, dtype=torch.float64)
    r = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)

    def f(x, w, r):
        out = rms_norm(x, w, 1e-5, residual=r) if residual else rms_norm(x, w, 1e-5)
        y, s = out if residual else (out, x)
        return (y * torch.linspace(-1, 1, 16, dtype=y.dtype)).sum() + s.square().sum()

    ops, _ = _graph_ops(f, x, w, r)
    assert "dropless.rms_norm.default" not in ops and any("rsqrt" in op for op in ops)
    ins_e = [t.clone().requires_grad_() for t in (x, w, r)]
    ins_c = [t.clone().requires_grad_() for t in (x, w, r)]
    le = f(*ins_e)
    lc = torch.compile(f, backend="aot_eager", fullgraph=True)(*ins_c)
    torch.testing.assert_close(lc, le)
    want = [i for i in range(3) if residual or i < 2]
    ge = torch.autograd.grad(le, [ins_e[i] for i in want])
    gc = torch.autograd.grad(lc, [ins_c[i] for i in want])
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_rms_norm_node_picks_its_implementation_when_it_runs():
    """The node (what a GPU's compiled region holds) asks the registry at run time: an
    entry registered after the function was compiled runs (as the Triton entry, registered
    on the first CUDA call, would)."""
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: rms_op.run(x, w, 1e-6, None), backend="aot_eager",
                      fullgraph=True)  # fmt: skip
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(f(x, w), rms_norm(x, w))
    calls = []

    def spy_fwd(*a):
        calls.append("forward")
        return rms_norm_fwd(*a)

    RMSNORM.register(RMSNormImpl("spy", lambda t: True, spy_fwd, None, priority=99))
    try:
        torch.testing.assert_close(f(x, w), rms_norm(x, w, backend="torch"))
    finally:
        del RMSNORM.entries["spy"]
    assert calls == ["forward"]


def test_rms_norm_exports_as_one_node():
    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            return rms_norm(x, self.weight, 1e-6)

    m, x = Norm(), torch.randn(2, 3, 16)
    ep = torch.export.export(m, (x,))
    assert "dropless.rms_norm.default" in [str(n.target) for n in ep.graph.nodes]
    torch.testing.assert_close(ep.module()(x), m(x))


def _ce_operands(T=9, D=6, V=11, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::4] = -100
    return h, w, b, labels


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_cross_entropy_opcheck(reduction, bias):
    h, w, b, labels = _ce_operands()
    args = (h.requires_grad_(), w.requires_grad_(), b.requires_grad_() if bias else None,
            labels, -100, 0.1, reduction, 4, [True, True, bias])  # fmt: skip
    torch.library.opcheck(ce_op.linear_cross_entropy_op, args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_linear_cross_entropy_compiles_to_one_node_equal_to_eager(dtype):
    h, w, b, labels = _ce_operands(T=20, dtype=dtype)

    def f(h, w, b, labels):
        return 3.0 * linear_cross_entropy(h, w, labels, b, label_smoothing=0.1, chunk_size=8)

    ops, _ = _graph_ops(f, h, w, b, labels)
    assert ops.count("dropless.linear_cross_entropy.default") == 1
    ins_e = [t.clone().requires_grad_() for t in (h, w, b)]
    ins_c = [t.clone().requires_grad_() for t in (h, w, b)]
    le = f(*ins_e, labels)
    lc = torch.compile(f, backend="aot_eager", fullgraph=True)(*ins_c, labels)
    torch.testing.assert_close(lc, le)
    for a, c in zip(torch.autograd.grad(lc, ins_c), torch.autograd.grad(le, ins_e)):
        assert a.dtype == c.dtype == dtype
        torch.testing.assert_close(a, c)


def test_linear_cross_entropy_node_picks_its_row_op_when_it_runs():
    torch._dynamo.reset()
    h, w, _, labels = _ce_operands()
    f = torch.compile(lambda h, w: linear_cross_entropy(h, w, labels), backend="aot_eager")
    want = linear_cross_entropy(h, w, labels)
    torch.testing.assert_close(f(h, w), want)
    calls = []

    def spy(*a, **k):
        calls.append(1)
        return EAGER_CE_ROWS.run(*a, **k)

    CE_ROWS.register(CERows("spy", spy, lambda t: True, priority=99))
    try:
        torch.testing.assert_close(f(h, w), want)
    finally:
        del CE_ROWS.entries["spy"]
    assert calls == [1]


def test_linear_cross_entropy_exports_as_one_node():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(11, 6))

        def forward(self, h, labels):
            return linear_cross_entropy(h, self.weight, labels)

    m = Head()
    h, _, _, labels = _ce_operands()
    ep = torch.export.export(m, (h, labels))
    # the autocast-off region is a nested graph module of the program
    targets = [str(n.target) for g in ep.graph_module.modules() for n in g.graph.nodes]
    assert "dropless.linear_cross_entropy.default" in targets
    torch.testing.assert_close(ep.module()(h, labels), m(h, labels))


@pytest.mark.parametrize("trans_w", [True, False], ids=["NxD", "DxN"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_grouped_gemm_opcheck(trans_w, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 6, generator=g).requires_grad_()
    w = torch.randn(3, 5, 6, generator=g) if trans_w else torch.randn(3, 6, 5, generator=g)
    b = torch.randn(3, 5, generator=g).requires_grad_() if bias else None
    counts = torch.tensor([4, 0, 5])  # an empty group
    torch.library.opcheck(gemm_op.grouped_gemm_op, (x, w.requires_grad_(), b, counts, trans_w))


def test_grouped_linear_compiles_once_for_any_group_sizes():
    """Tensor m_splits: one node, no break, and new sizes reuse the graph (a list or a
    `.tolist()` would specialise it or break it)."""
    torch._dynamo.reset()
    lin = GroupedLinear(3, 6, 5, dtype=torch.float64)
    x = torch.randn(9, 6, dtype=torch.float64)
    ops, _ = _graph_ops(lin, x, torch.tensor([4, 0, 5]))
    assert "dropless.grouped_gemm.default" in ops
    torch._dynamo.reset()
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for splits in ([4, 0, 5], [9, 0, 0], [1, 1, 7]):  # all rows on one group, too
            xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
            ye, yc = lin(xe, splits), compiled(xc, torch.tensor(splits))
            torch.testing.assert_close(yc, ye)
            gy = torch.randn_like(ye)
            ge = torch.autograd.grad(ye, [xe, lin.weight, lin.bias], gy)
            gc = torch.autograd.grad(yc, [xc, lin.weight, lin.bias], gy)
            for a, b in zip(gc, ge):
                torch.testing.assert_close(a, b)


def test_grouped_gemm_exports_as_one_node():
    lin = GroupedLinear(3, 6, 5)
    x, splits = torch.randn(9, 6), torch.tensor([4, 0, 5])
    ep = torch.export.export(lin, (x, splits))
    assert "dropless.grouped_gemm.default" in [str(n.target) for n in ep.graph.nodes]
    torch.testing.assert_close(ep.module()(x, torch.tensor([2, 7, 0])), lin(x, [2, 7, 0]))


ROUTINGS = {
    "softmax": dict(score_func="softmax", renormalize=False),
    "softmax_renorm": dict(score_func="softmax", renormalize=True, scaling_factor=2.5),
    "sigmoid_groups_bias": dict(score_func="sigmoid", renormalize=True, n_group=4, topk_group=2),
}


def _route_operands(case, T=10, E=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=dtype)
    bias = torch.randn(E, generator=g) * 0.1 if case == "sigmoid_groups_bias" else None
    return logits, bias, RoutingConfig(**ROUTINGS[case], expert_bias=bias is not None)


@pytest.mark.parametrize("case", list(ROUTINGS))
def test_route_opcheck(case):
    logits, bias, r = _route_operands(case)
    grouped = r.n_group or 0
    args = (logits.requires_grad_(), bias, 3, r.score_func, r.renormalize,
            float(r.scaling_factor), grouped, r.topk_group or 0)  # fmt: skip
    torch.library.opcheck(route_op.route_op, args)


@pytest.mark.parametrize("case", list(ROUTINGS))
def test_route_compiles_to_one_node_equal_to_eager(case):
    """route_with_aux compiled: one `dropless::route` node; weights, scores, the losses'
    inputs and the logits' gradient equal eager's (fp64)."""
    logits, bias, r = _route_operands(case, dtype=torch.float64)

    def f(logits):
        w, ids, scores, pm, z = route_with_aux(logits, 3, r, expert_bias_E=bias)
        scale = torch.linspace(-1, 1, ids.numel(), dtype=w.dtype).view_as(w)
        return (w * scale).sum() + scores.square().sum() + (pm * pm).sum() + z, ids

    ops, _ = _graph_ops(f, logits)
    assert ops.count("dropless.route.default") == 1
    le_in, lc_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    (le, ids_e), (lc, ids_c) = (
        f(le_in),
        torch.compile(f, backend="aot_eager", fullgraph=True)(lc_in),
    )
    assert torch.equal(ids_c, ids_e)
    torch.testing.assert_close(lc, le)
    torch.testing.assert_close(torch.autograd.grad(lc, lc_in)[0], torch.autograd.grad(le, le_in)[0])


def test_route_node_picks_its_implementation_when_it_runs():
    """A routing entry registered after compiling runs inside the node (as "triton" does
    on the first CUDA routing); its raw forward is what the node returns."""
    torch._dynamo.reset()
    logits, _, r = _route_operands("softmax")
    f = torch.compile(lambda t: route(t, 2, r)[0], backend="aot_eager", fullgraph=True)
    want = route(logits, 2, r)[0]
    torch.testing.assert_close(f(logits), want)
    calls = []

    def fwd(logits_TE, top_k, routing, bias, *, stats):
        calls.append(stats)
        w, ids, scores = route_reference(logits_TE, top_k, routing, expert_bias_E=bias)
        return w, ids, scores, mean_normalised_scores(scores) * len(w), torch.zeros(())

    ROUTING.register(RoutingKernels("spy", None, None, lambda t: True, priority=99, route_fwd=fwd))
    try:
        torch.testing.assert_close(f(logits), want)
    finally:
        del ROUTING.entries["spy"]
    assert calls == [True]


def test_route_exports_as_one_node():
    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 16))

        def forward(self, x):
            return route(torch.nn.functional.linear(x, self.weight), 2, renormalize=True)[:2]

    m, x = Router(), torch.randn(5, 16)
    ep = torch.export.export(m, (x,))
    assert "dropless.route.default" in [str(n.target) for n in ep.graph.nodes]
    other = torch.randn(5, 16)
    for a, b in zip(ep.module()(other), m(other)):
        torch.testing.assert_close(a, b)
