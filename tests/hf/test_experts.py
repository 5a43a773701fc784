"""The experts forward beyond the discovery test: hooks that see the router's choice, and
Transformers' own expert-parallel sentinels (ids >= E from other ranks)."""

# T tokens, D model dim, E experts, K top-k

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import dropless.hf as dh
from dropless.hf import experts as ex
from dropless.hf.patching.discovery import tiny_experts


def test_experts_hook_sees_each_call_and_is_removable():
    module = tiny_experts(Qwen3MoeExperts, experts=5)
    seen = []
    handle = dh.register_experts_hook(lambda m, ids, w: seen.append((m, ids.clone(), w.clone())))
    x = torch.randn(4, 12, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [2, 3], [4, 0], [1, 2]])
    w = torch.rand(4, 2, dtype=torch.float64)
    ex.dropless_experts_forward(module, x, ids, w)
    handle.remove()
    ex.dropless_experts_forward(module, x, ids, w)
    assert len(seen) == 1 and seen[0][0] is module
    assert torch.equal(seen[0][1], ids) and torch.equal(seen[0][2], w)
    with pytest.raises(TypeError, match="needs a callable, got int"):
        dh.register_experts_hook(3)


def test_expert_parallel_sentinels_match_stock_grouped_mm():
    from transformers.integrations.moe import grouped_mm_experts_forward

    E = 5
    module = tiny_experts(Qwen3MoeExperts, experts=E, dtype=torch.float32)
    module._is_expert_parallel = True
    g = torch.Generator().manual_seed(0)
    T = 6
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    ids[::2, 1] = E  # pairs routed to other ranks
    w = torch.rand(T, 2, generator=g)
    w[::2, 1] = 0.0  # Transformers zeroes their weights at dispatch
    x = torch.randn(T, 12, generator=g)

    def run(forward):
        module.zero_grad(set_to_none=True)
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = forward(module, xl, ids, wl)
        out.square().sum().backward()
        return out.detach(), xl.grad, wl.grad, module.gate_up_proj.grad, module.down_proj.grad

    for got, want in zip(run(ex.dropless_experts_forward), run(grouped_mm_experts_forward)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert int(module.__dict__["_dropless_last_counts_E"].sum()) == 2 * T - T // 2


def _eager_vs_ours(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 12, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g, dtype=torch.float64)
    outs = []
    for forward in (type(module).forward.__wrapped__, ex.dropless_experts_forward):
        module.zero_grad(set_to_none=True)
        out = forward(module, x, ids, w)
        out.square().sum().backward()
        outs.append([out.detach()] + [p.grad.clone() for p in module.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("act", ["quick_gelu", "gelu_10", "xielu"])
def test_any_act_fn_is_fused_or_run_as_is(act):
    """An ACT2FN entry without a built-in kind: parameter-free ones become a registered
    elementwise kind on the fused path; a learnable one (xielu) runs the generic path."""
    import warnings

    from transformers.activations import ACT2FN

    module = tiny_experts(Qwen3MoeExperts, experts=5)
    module.act_fn = ACT2FN[act].to(torch.float64)
    spec = dh.experts_spec(module)
    if act == "xielu":
        assert spec.path == "generic" and "matches no fused form" in spec.reason
    else:
        assert spec.path == "fused" and spec.activation.kind.endswith(
            type(module.act_fn).__qualname__ + ("(max=10, min=-10)" if act == "gelu_10" else "")
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _eager_vs_ours(module)
    generic = [c for c in caught if issubclass(c.category, dh.DroplessGenericGateWarning)]
    assert len(generic) == (1 if act == "xielu" else 0)
