"""A patched model compiles and exports as the stock model does (docs/performance.md).

`torch.compile(model, fullgraph=True)` traces a patched model into one graph, cold (no
eager call first) and warm; same-shape calls with other inputs and other routings reuse
it (no recompilation: nothing per call, such as a call counter, is guarded on);
`torch.export` records the expert MLP as the `dropless::expert_mlp` node; compiled
forward and backward give the eager numbers for every family on the dropless path.
"""

import pytest
import torch
from families import FAMILIES, build

import dropless.hf as dh

# aot_eager runs AOTAutograd (the custom op's autograd and fake rules) without inductor's
# C++ compile; Dynamo's tracing (what fullgraph checks) is the same as inductor's
BACKEND = "aot_eager"


def _ids(seed: int, T: int = 6) -> torch.Tensor:
    return torch.randint(2, 96, (2, T), generator=torch.Generator().manual_seed(seed))


def _patched(family: str = "qwen3_moe"):
    dh.patch()
    model = build(family, implementation=None).eval()
    assert dh.report().families, "the model is on the dropless path"
    return model


def test_fullgraph_cold_and_warm_without_recompiling():
    torch._dynamo.reset()
    model = _patched()
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(4):  # the first call compiles before any eager call (cold)
            ids = _ids(seed)
            got = compiled(ids, use_cache=False).logits
            torch.testing.assert_close(got, model(ids, use_cache=False).logits)


def test_export_records_the_custom_op_and_matches_eager():
    model = _patched()
    ids = _ids(0)
    with torch.no_grad():
        exported = torch.export.export(model, (ids,), {"use_cache": False})
        targets = {str(n.target) for n in exported.graph.nodes}
        assert "dropless.expert_mlp.default" in targets
        for seed in (1, 2):  # other tokens route otherwise: the graph is not specialised
            other = _ids(seed)
            got = exported.module()(other, use_cache=False).logits
            torch.testing.assert_close(got, model(other, use_cache=False).logits)


# AOTAutograd (the op's fake and autograd rules, also checked by opcheck in
# tests/ops/test_expert_mlp_op.py) for one family; Dynamo's graph (backend "eager") for
# the others
AOT = ("qwen3_moe",)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_forward_and_backward_match_eager(family):
    torch._dynamo.reset()
    backend = BACKEND if family in AOT else "eager"
    model = _patched(family).train()
    ids = _ids(0)

    def step(m):
        loss = m(ids, labels=ids, use_cache=False).loss
        return loss, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    loss_c, grads_c = step(torch.compile(model, fullgraph=True, backend=backend))
    loss_e, grads_e = step(model)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for c, e in zip(grads_c, grads_e):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-6)


def test_generate_with_a_compiled_forward_and_static_cache():
    """Transformers' compiled generation (`test_generate_compile_model_forward_fullgraph`):
    the static cache makes generate compile the forward with fullgraph=True; the tokens
    equal eager generation's, and a second generate reuses the graph."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = _patched()
    ids = _ids(0, T=5)
    kwargs = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    want = model.generate(ids, **kwargs)
    compile_config = CompileConfig(fullgraph=True, backend=BACKEND, mode=None)
    compile_config._compile_all_devices = True  # generate compiles on GPUs only otherwise
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            got = model.generate(ids, compile_config=compile_config, **kwargs)
            assert torch.equal(got, want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "generate compiled"
