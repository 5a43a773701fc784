"""The expert path is chosen once, by `plan.plan_expert_mlp`: its decisions tested
directly (path, one GEMM backend for both projections, counts on the device or the host,
the recipe, the eager fallback under compile), and the plan's promise kept: a backend
that declares device counts gets no host sync."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

import pytest
import torch
from sync_counter import count_syncs

import dropless
from dropless import ops
from dropless.ops import dispatch
from dropless.ops.expert_mlp.plan import plan_expert_mlp
from dropless.ops.grouped_gemm import backends
from dropless.ops.grouped_gemm.backends import GemmBackend
from dropless.ops.reference import expert_mlp_reference
from dropless.ops.specs import ActivationConfig

SWIGLU = ActivationConfig()


def _operands(device="cpu", D=16, F=8, E=4, T=6, dtype=torch.float32):
    x = torch.randn(T, D, device=device, dtype=dtype)
    return (
        x,
        torch.randn(E, 2 * F, D, device=device, dtype=dtype),
        torch.randn(E, D, F, device=device, dtype=dtype),
    )


def test_cpu_default_is_the_loop_with_host_counts():
    plan = plan_expert_mlp(*_operands(), SWIGLU)
    assert (plan.path, plan.backend, plan.device_counts) == ("loop", None, False)


def test_named_grouped_mm_keeps_counts_on_the_device_unless_pairs_may_drop():
    x, gu, dn = _operands()
    plan = plan_expert_mlp(x, gu, dn, SWIGLU, backend="grouped_mm")
    assert (plan.path, plan.backend.name, plan.device_counts) == ("grouped", "grouped_mm", True)
    assert plan.row_ops.name == "eager" and plan.act_row_ops.name == "eager"
    capped = plan_expert_mlp(x, gu, dn, SWIGLU, backend="grouped_mm", capacity=True)
    assert capped.path == "grouped" and not capped.device_counts


def test_the_backend_must_run_both_projections(monkeypatch):
    """auto (a non-CPU device: the grouped path) takes the best backend that runs gate_up
    AND down; one that runs only gate_up is passed over, and so are its device counts."""
    up_only = GemmBackend(
        "test_up_only", backends._BACKENDS["loop"].mm, backends._BACKENDS["loop"].wgrad,
        supports=lambda a, b: b.shape[-1] == 16, priority=100, device_counts=True,
    )  # fmt: skip
    monkeypatch.setitem(backends._BACKENDS, "test_up_only", up_only)
    x, gu, dn = _operands("meta", D=16, F=8)
    plan = plan_expert_mlp(x, gu, dn, SWIGLU)
    assert plan.path == "grouped" and plan.backend.name == "loop" and not plan.device_counts
    x, gu, dn = _operands("meta", D=16, F=16)  # now it runs both
    plan = plan_expert_mlp(x, gu, dn, SWIGLU)
    assert plan.backend.name == "test_up_only" and plan.device_counts


def test_a_down_projection_update_needs_the_torch_activation_backward():
    x, gu, dn = _operands()
    lr = ops.LowRank(torch.randn(4, 2, 8), torch.randn(4, 16, 2), 0.5)
    plan = plan_expert_mlp(x, gu, dn, SWIGLU, backend="grouped_mm", lora=(None, lr))
    assert plan.act_row_ops is None
    plan = plan_expert_mlp(x, gu, dn, ActivationConfig("gelu"), backend="grouped_mm")
    assert plan.act_row_ops is None  # the row ops compute swiglu and gpt_oss only


class _Recipe:
    kind = "test_recipe"

    def grouped_gemm(self, x_SD, w, counts, bias, trans_w):
        raise AssertionError("not called")


def test_a_recipe_takes_the_path_and_refuses_low_rank_factors():
    x, gu, dn = _operands()
    token = dispatch.set_recipe(_Recipe())
    try:
        plan = plan_expert_mlp(x, gu, dn, SWIGLU, backend="grouped_mm")
        assert (plan.path, plan.recipe_mlp, plan.takes_tokens, plan.device_counts) == (
            "recipe", None, False, False,
        )  # fmt: skip
        lr = ops.LowRank(torch.randn(4, 2, 16), torch.randn(4, 16, 2), 0.5)
        with pytest.raises(ValueError, match="full precision only"):
            plan_expert_mlp(x, gu, dn, SWIGLU, lora=(lr, None))
    finally:
        dispatch.reset_recipe(token)


def test_auto_under_compile_is_the_grouped_path(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x, gu, dn = _operands(dtype=torch.bfloat16)  # grouped_mm's fake kernel takes bf16 only
    assert plan_expert_mlp(x, gu, dn, SWIGLU).path == "grouped"


def test_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="expected one of"):
        plan_expert_mlp(*_operands(), SWIGLU, path="fused")


def test_a_backend_that_declares_device_counts_gets_no_host_sync(monkeypatch):
    """The capability, not the name: a backend other than grouped_mm that takes device
    counts (as Triton's does) runs the layer without reading the counts on the host."""
    gmm = backends._BACKENDS["grouped_mm"]
    other = GemmBackend("test_device_counts", gmm.mm, gmm.wgrad, gmm.supports, -1, True)
    monkeypatch.setitem(backends._BACKENDS, "test_device_counts", other)
    moe = dropless.MoE(16, 8, 6, 2, backend="test_device_counts")
    x = torch.randn(2, 5, 16, requires_grad=True)
    out, aux = moe(x)  # first call: lazy registrations, caches
    with count_syncs() as found:
        out, aux = moe(x)
        (out.square().sum() + aux.lb_loss).backward()
    assert found == []


def test_the_device_counts_path_matches_the_reference(monkeypatch):
    gmm = backends._BACKENDS["grouped_mm"]
    other = GemmBackend("test_device_counts", gmm.mm, gmm.wgrad, gmm.supports, -1, True)
    monkeypatch.setitem(backends._BACKENDS, "test_device_counts", other)
    g = torch.Generator().manual_seed(3)
    x, gu, dn = (torch.randn(s, generator=g) for s in ((7, 16), (4, 16, 16), (4, 16, 8)))
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])
    w = torch.rand(7, 2, generator=g)
    out, sp = ops.expert_mlp(x, ids, w, gu, dn, backend="test_device_counts")
    assert sp.counts is None  # nothing was read on the host
    torch.testing.assert_close(out, expert_mlp_reference(x, ids, w, gu, dn), rtol=1e-5, atol=1e-5)


def test_the_plan_holds_the_sort_and_a_fake_tensor_plans_apart(monkeypatch):
    """The sort is chosen with the plan (the routing kernel that runs the device, else the
    torch sort) and the call runs it from there; a fake tensor's plan is its own, so a
    kernel that reads data is never picked for one, nor refused for real tensors after."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from dropless.ops.permute.eager import torch_sort_by_expert
    from dropless.ops.routing import ROUTING, RoutingKernels

    ran = []

    def sort(ids_TK, num_experts, keep_TK=None, *, host_counts=True):
        ran.append(ids_TK.shape)
        return torch_sort_by_expert(ids_TK, num_experts, keep_TK, host_counts=host_counts)

    kernels = RoutingKernels("test", None, sort, supports=lambda t: not is_fake(t), priority=5)
    monkeypatch.setitem(ROUTING.entries, "test", kernels)
    x, gu, dn = _operands()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert plan_expert_mlp(mode.from_tensor(x), gu, dn, SWIGLU).sort is torch_sort_by_expert
    assert plan_expert_mlp(x, gu, dn, SWIGLU).sort is sort
    ids = torch.randint(0, gu.shape[0], (x.shape[0], 2))
    out, sp = ops.expert_mlp(x, ids, torch.rand(x.shape[0], 2), gu, dn)
    assert ran == [ids.shape] and sp.counts == torch.bincount(ids.flatten(), minlength=4).tolist()
