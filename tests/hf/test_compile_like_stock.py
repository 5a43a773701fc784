"""A patched model compiles and exports as the stock model does (docs/performance.md).

One combined check per family of families.py (fused RMSNorm and fused cross-entropy on):
`torch.compile(model, fullgraph=True)` traces the patched model into one graph, cold (no
eager call first); its forward and backward equal eager; a second input shape, with other
tokens and other routings, runs the same graph (`dynamic=True`, `error_on_recompile`:
nothing per call, such as a call counter, is guarded on). Families whose stock
model fails the same check are xfail(strict=True) with stock's error. `torch.export`
records the expert MLP as the `dropless::expert_mlp` node for the 7 main families. A
compiled checkpointed training step equals the eager one (routing replay is off inside a
compiled region: its recompute routes as the forward did without it).
"""

import pytest
import torch
from families import FAMILIES, MORE_FAMILIES, build, config
from torch._dynamo.exc import RecompileError

import dropless.hf as dh
from dropless.hf.fusions.fused_loss import is_fused_cross_entropy_enabled
from dropless.hf.fusions.rmsnorm import fused_rmsnorm_state

# aot_eager runs AOTAutograd (the custom op's autograd and fake rules) without inductor's
# C++ compile; Dynamo's tracing (what fullgraph checks) is the same as inductor's
BACKEND = "aot_eager"


def _ids(seed: int, T: int = 6, B: int = 2) -> torch.Tensor:
    return torch.randint(2, 96, (B, T), generator=torch.Generator().manual_seed(seed))


def _patched(family: str = "qwen3_moe", **options):
    dh.patch(**options)
    model = build(family, implementation=None).eval()
    assert dh.report().families, "the model is on the dropless path"
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_export_records_the_custom_ops_and_matches_eager(family):
    model = _patched(family, fused_rmsnorm=True)
    ids = _ids(0)
    with torch.no_grad():  # export records the norms as nodes, on CPU too
        exported = torch.export.export(model, (ids,), {"use_cache": False})
        targets = {str(n.target) for n in exported.graph.nodes}
        assert "dropless.expert_mlp.default" in targets
        assert "dropless.rms_norm.default" in targets
        for seed in (1, 2):  # other tokens route otherwise: the graph is not specialised
            other = _ids(seed)
            got = exported.module()(other, use_cache=False).logits
            torch.testing.assert_close(got, model(other, use_cache=False).logits)


# the stock model of these families fails the same check (Transformers' own code), so the
# patched one cannot pass it either: stock's error
STOCK_FAILS = {
    "jamba": "stock: RecompileError at the second shape: guard (L % 2) == 0 from "
    "associative_scan in modeling_jamba.py mamba_selective_scan",
    "minimax": "stock: RecompileError at the second shape: guard (-4 + min(8, L)) != 1 "
    "from the lightning attention's matmul in modeling_minimax.py",
}


def _params() -> list:
    out = []
    for family in (*FAMILIES, *MORE_FAMILIES):
        reason = STOCK_FAILS.get(family)
        marks = ()
        if reason is not None:
            marks = pytest.mark.xfail(raises=RecompileError, strict=True, reason=reason)
        out.append(pytest.param(family, marks=marks))
    return out


def compile_check(model) -> set[str]:
    """Fullgraph forward+backward of `model` under Dynamo's eager backend equal to eager
    at two input shapes, without recompiling; returns the call targets of the graph."""
    torch._dynamo.reset()
    params = [p for p in model.parameters() if p.requires_grad]
    graphs = []

    def backend(gm, example_inputs):  # Dynamo's "eager" backend, keeping the graph
        graphs.append(gm)
        return gm.forward

    def step(m, ids):
        loss = m(ids, labels=ids, use_cache=False).loss
        return loss, torch.autograd.grad(loss, params, allow_unused=True)

    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, (B, T) in enumerate(((2, 6), (3, 5))):
            ids = _ids(seed, T, B)
            loss_c, grads_c = step(compiled, ids)
            loss_e, grads_e = step(model, ids)
            torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
            for c, e in zip(grads_c, grads_e):  # None: a parameter this input never reaches
                assert (c is None) == (e is None)
                if c is not None:
                    torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-6)
    assert len(graphs) == 1
    return {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}


def _alike_layers(family: str) -> dict:
    """One decoder layer where the family's two are alike (Dynamo traces every layer: a
    second one adds time, not coverage); both where they differ (attention kinds, a
    hybrid pattern, a dense first layer)."""
    cfg = config(family)
    mixed = len(set(getattr(cfg, "layer_types", None) or ())) > 1
    return {} if mixed or getattr(cfg, "first_k_dense_replace", 0) else {"num_hidden_layers": 1}


@pytest.mark.parametrize("family", _params())
def test_compiles_like_eager(family):
    dh.patch(fused_cross_entropy=True, fused_rmsnorm=True)
    model = build(family, implementation=None, **_alike_layers(family)).train()
    assert dh.moe_layers(model), "the model keeps an experts layer"
    targets = compile_check(model)
    # dropless's RMSNorm on CPU: its one Function traced (the compiler fuses it), no node
    assert "dropless.rms_norm.default" not in targets
    if any(fused_rmsnorm_state(m) == "kernel" for m in model.modules()):
        assert "autograd_function_apply" in targets
    fused_ce = is_fused_cross_entropy_enabled(model)
    assert ("dropless.linear_cross_entropy.default" in targets) == fused_ce


def test_compiled_checkpointed_step_equals_eager():
    """Gradient checkpointing inside a compiled region: the recompute runs the router on
    the same saved inputs, so it routes as the forward did (routing replay's hooks return
    at once there); loss and gradients equal an eager step without checkpointing."""
    torch._dynamo.reset()
    model = _patched(fused_rmsnorm=True).train()
    ids = _ids(0)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(m):
        loss = m(ids, labels=ids, use_cache=False).loss
        return loss, torch.autograd.grad(loss, params)

    want_loss, want = step(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    got_loss, got = step(compiled)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


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


def test_specs_are_computed_at_wiring_and_an_unwired_module_compiles_as_stock():
    """patch() computes each experts module's spec when the model is built (post_init),
    so a compiled forward only reads it. A module without one (here removed) runs stock's
    default (grouped_mm) forward inside a compiled region, fullgraph, with eager's logits,
    and the compiled forward writes nothing on it; its next eager call computes it."""
    from dropless.hf.experts.forward import SPEC_ATTR

    torch._dynamo.reset()
    model = _patched()
    experts = [layer.experts for layer in dh.moe_layers(model)]
    assert experts and all(SPEC_ATTR in vars(m) for m in experts)
    for m in experts:
        del m.__dict__[SPEC_ATTR]
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    ids = _ids(0)
    with torch.no_grad():
        got = compiled(ids, use_cache=False).logits
        assert not any(SPEC_ATTR in vars(m) for m in experts)
        want = model(ids, use_cache=False).logits
    assert all(SPEC_ATTR in vars(m) for m in experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
