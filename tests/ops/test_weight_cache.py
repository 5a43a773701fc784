"""ops.weight_cache: a weight is converted once while nothing can have changed it, and a
changed weight is never served from the cache (version bump, optimizer step, FSDP2-style
re-gather with the version counter restored, `.data =`, autograd state); the expert path
under autocast computes in the autocast dtype and reuses the cast weights."""

from __future__ import annotations

import pytest
import torch

from dropless.nn import MoE
from dropless.ops import expert_mlp, weight_cache
from dropless.ops.weight_cache import cached_cast

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _empty_cache():
    weight_cache.clear()
    yield
    weight_cache.clear()


def _param(*shape):
    return torch.nn.Parameter(torch.randn(*shape))


def _stored(p, fn=None):
    return weight_cache._CACHE[p][(BF16, fn)][2]


def test_hits_within_a_step_and_misses_after_an_optimizer_step():
    p = _param(4, 3)
    a = cached_cast(p, BF16)
    assert a.dtype == BF16 and a.grad_fn is not None  # differentiable
    stored = _stored(p)
    b = cached_cast(p, BF16)  # the recompute and the next micro-batch
    assert b.data_ptr() == a.data_ptr() and _stored(p) is stored
    (a.float().sum() + 2 * b.float().sum()).backward()
    assert p.grad.dtype == torch.float32
    torch.testing.assert_close(p.grad, torch.full_like(p, 3.0))
    opt = torch.optim.SGD([p], lr=0.5)
    opt.step()
    assert len(weight_cache._CACHE) == 0  # nothing outlives the step
    c = cached_cast(p, BF16)
    assert c.data_ptr() != a.data_ptr()
    torch.testing.assert_close(c, p.detach().to(BF16), rtol=0, atol=0)


def test_an_in_place_write_is_never_served_stale():
    p = _param(4, 3)
    stored = (cached_cast(p, BF16), _stored(p))[1]
    with torch.no_grad():
        p.mul_(2)  # a manual edit, load_state_dict's copy_: the version moves
    b = cached_cast(p, BF16)
    assert _stored(p) is not stored
    torch.testing.assert_close(b, p.detach().to(BF16), rtol=0, atol=0)


def test_a_regather_that_restores_the_version_misses_after_the_step():
    """FSDP2 writes each all-gather into the same unsharded Parameter and restores its
    version counter: only the optimizer step tells that the values are new."""
    p, shard = _param(4, 3), _param(4, 3)
    cached_cast(p, BF16)
    v = p._version
    with torch.no_grad():
        p.copy_(torch.randn(4, 3))
    torch._C._autograd._unsafe_set_version_counter((p,), (v,))
    assert p._version == v
    torch.optim.SGD([shard], lr=0.1).step()  # the sharded parameter's update
    torch.testing.assert_close(cached_cast(p, BF16), p.detach().to(BF16), rtol=0, atol=0)


def test_data_assignment_misses():
    p = _param(4, 3)
    stored = (cached_cast(p, BF16), _stored(p))[1]
    p.data = torch.randn(4, 3)
    torch.testing.assert_close(cached_cast(p, BF16), p.detach().to(BF16), rtol=0, atol=0)
    assert _stored(p) is not stored


def test_a_no_grad_cast_still_carries_the_gradient_when_reused():
    """A reentrant checkpoint runs its forward under no_grad and recomputes with grad."""
    p = _param(4, 3)
    with torch.no_grad():
        a = cached_cast(p, BF16)
    assert a.grad_fn is None
    b = cached_cast(p, BF16)
    assert b.grad_fn is not None and b.data_ptr() == a.data_ptr()
    b.float().sum().backward()
    torch.testing.assert_close(p.grad, torch.ones_like(p))


def test_inference_casts_stay_in_inference_mode():
    p = _param(4, 3)
    with torch.inference_mode():
        a = cached_cast(p, BF16)
    b = cached_cast(p, BF16)
    assert a.is_inference() and not b.is_inference()


def test_same_dtype_and_non_leaves_are_not_cached():
    p = _param(4, 3)
    assert cached_cast(p, torch.float32) is p
    view = p * 1  # e.g. a DTensor's to_local(): a new tensor per call
    cached_cast(view, BF16)
    assert len(weight_cache._CACHE) == 0


def test_fn_makes_other_derived_forms_under_the_same_rules():
    p = _param(4, 3)
    calls = []

    def scaled(t):
        calls.append(1)
        return (t.detach().abs().amax(), t.detach().to(BF16))

    first = cached_cast(p, BF16, scaled)
    assert cached_cast(p, BF16, scaled) is first and len(calls) == 1
    assert cached_cast(p, BF16) is not first  # the plain cast is its own entry
    with torch.no_grad():
        p.add_(1)
    cached_cast(p, BF16, scaled)
    assert len(calls) == 2


def test_entries_die_with_their_weight():
    p = _param(4, 3)
    cached_cast(p, BF16)
    assert len(weight_cache._CACHE) == 1
    del p
    assert len(weight_cache._CACHE) == 0


def test_expert_mlp_under_autocast_casts_once_and_computes_in_bf16():
    torch.manual_seed(0)
    E, D, F, T, K = 4, 8, 6, 12, 2
    gu, dn = _param(E, 2 * F, D) * 0.3, _param(E, D, F) * 0.3
    gu, dn = torch.nn.Parameter(gu.detach()), torch.nn.Parameter(dn.detach())
    x = torch.randn(T, D)
    ids = torch.randint(0, E, (T, K))
    w = torch.rand(T, K)
    ref, _ = expert_mlp(x, ids, w, gu, dn)
    with torch.autocast("cpu", dtype=BF16):
        out, _ = expert_mlp(x, ids, w, gu, dn)
        cast = _stored(gu)
        out2, _ = expert_mlp(x, ids, w, gu, dn)
        assert _stored(gu) is cast  # no second cast
    assert out.dtype == BF16
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    # bf16 operands, fp32 reference: a few bf16 steps (2^-8) of the output's scale
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    (out.float().sum() + out2.float().sum()).backward()
    assert gu.grad.dtype == torch.float32 and dn.grad.dtype == torch.float32


def test_without_autocast_nothing_changes_and_nothing_is_cached():
    torch.manual_seed(0)
    m = MoE(8, 6, 4, 2)
    x = torch.randn(5, 8)
    y, _ = m(x)
    assert y.dtype == torch.float32 and len(weight_cache._CACHE) == 0


def test_moe_under_checkpoint_recompute_reuses_the_cast():
    """The recompute of a checkpointed layer (non-reentrant) finds the forward's casts."""
    torch.manual_seed(0)
    m = MoE(8, 6, 4, 2)
    x = torch.randn(5, 8, requires_grad=True)
    weights = (m.experts.gate_up_proj, m.experts.down_proj)
    with torch.autocast("cpu", dtype=BF16):
        y = torch.utils.checkpoint.checkpoint(lambda t: m(t)[0], x, use_reentrant=False)
    made = [_stored(w) for w in weights]
    y.float().sum().backward()
    assert all(_stored(w) is c for w, c in zip(weights, made))  # no cast again
    assert all(w.grad.dtype == torch.float32 for w in weights)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_lora_factors_and_biases_under_autocast(backend):
    """Frozen fp32 base weights, trainable fp32 factors and biases under bf16 autocast:
    everything runs in bf16 and the factors' and biases' gradients are fp32, within bf16
    tolerance of the fp32 run."""
    from dropless.ops import LowRank

    g = torch.Generator().manual_seed(3)
    E, D, F, T, K, r = 4, 16, 8, 12, 2, 2

    def leaf(*shape, scale=0.3, grad=True):
        return torch.nn.Parameter(torch.randn(*shape, generator=g) * scale, requires_grad=grad)

    gu, dn = leaf(E, 2 * F, D, grad=False), leaf(E, D, F, grad=False)
    gb, db = leaf(E, 2 * F), leaf(E, D)
    a1, b1, a2, b2 = leaf(E, r, D), leaf(E, 2 * F, r), leaf(E, r, F), leaf(E, D, r)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    lora = (LowRank(a1, b1, 2.0), LowRank(a2, b2, 0.5))
    trained = (gb, db, a1, b1, a2, b2)

    def run():
        out, _ = expert_mlp(
            x, ids, w, gu, dn, gate_up_bias=gb, down_bias=db, lora=lora, backend=backend
        )
        grads = torch.autograd.grad(out.float().pow(2).sum(), trained)
        return out, grads

    ref, ref_grads = run()
    with torch.autocast("cpu", dtype=BF16):
        out, grads = run()
    assert out.dtype == BF16
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2 * float(ref.abs().max()))
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.float32
        err = float((got - want).norm() / want.norm())
        assert err < 3e-2, err
