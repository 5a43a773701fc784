"""dropless.MoE under torch.compile on CPU gives the eager results, forward and backward.

The expert MLP is one `dropless::expert_mlp` custom-op node of the compiled graph (see
docs/performance.md); this checks it against eager and that the graph is not
re-specialised on the routing (a second batch with other routes reuses it).
"""

# T tokens, D model dim

import os

import pytest
import torch
from torch._dynamo.utils import counters

import dropless
import dropless.quant
from dropless import MoE

# inductor compiles C++ (~70 s on 2 busy cores): opt-in with DROPLESS_SLOW_TESTS=1 to
# stay inside the ops+nn budget; aot_eager traces the same graphs and autograd.
INDUCTOR = pytest.param(
    "inductor",
    marks=[
        pytest.mark.slow,
        pytest.mark.skipif(
            not os.environ.get("DROPLESS_SLOW_TESTS"), reason="set DROPLESS_SLOW_TESTS=1"
        ),
    ],
)


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_moe_compiled_matches_eager(backend):
    torch._dynamo.reset()
    moe = MoE(16, 8, 4, 2, bias=True)
    with torch.no_grad():
        moe.experts.gate_up_proj_bias.normal_()
        moe.experts.down_proj_bias.normal_()

    def loss(m, x):
        out, aux = m(x)
        return (out * torch.linspace(-1, 1, out.shape[-1])).sum() + aux.lb_loss

    compiled = torch.compile(moe, backend=backend)
    graphs = []
    for step in range(2):  # the second batch routes differently: no error, no mismatch
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(step))
        xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        le = loss(moe, xe)
        ge = torch.autograd.grad(le, [xe, *moe.parameters()])
        lc = loss(compiled, xc)
        gc = torch.autograd.grad(lc, [xc, *moe.parameters()])
        graphs.append(counters["stats"]["unique_graphs"])
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert graphs[1] == graphs[0], f"recompiled for new routes: {graphs}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_dropless_forward_is_one_graph(dtype):
    """docs/performance.md: a full-precision dropless forward compiles to one graph (the
    expert MLP is the `dropless::expert_mlp` custom op); no break may appear unnoticed
    (e.g. an out= into a non-contiguous view in the activation backward)."""
    torch._dynamo.reset()
    moe = MoE(16, 8, 4, 2, dtype=dtype)
    x = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
    explained = torch._dynamo.explain(moe)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes]
    assert "dropless.expert_mlp.default" in ops


def test_a_recipe_breaks_the_graph_once_around_the_expert_mlp():
    """What the custom op does not take (here an FP8 recipe) runs outside the graph, as
    docs/performance.md says: one break site, at the expert MLP."""
    torch._dynamo.reset()
    moe = MoE(32, 64, 4, 2, dtype=torch.bfloat16)
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    with dropless.quant.autocast(recipe=dropless.quant.Float8CurrentScaling()):
        explained = torch._dynamo.explain(moe)(x)
    sites = [r.user_stack[-1].name for r in explained.break_reasons]
    assert sites == ["expert_mlp"], explained.break_reasons
