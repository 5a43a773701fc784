"""Routing replay: a checkpointed MoE layer recomputes with the experts its forward chose.

Between the forward and the recompute the router is changed in place, as low-precision
noise, ties or an expert-bias update would. What must hold (fp64, exact):
- the expert score bias changes only which experts are chosen: with replay every
  gradient (input, router weight, expert weights) equals the unperturbed run without
  checkpointing; without replay the recompute routes elsewhere and they differ;
- the router weight changes the scores too: with replay the gradients equal those of a
  run without checkpointing whose router has the new weight but whose tokens go to the
  experts the forward chose (the recompute computes its routing weights from the
  current scores at the recorded choice).
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

import contextlib
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointError, checkpoint

import dropless.nn.moe as moe_mod
from dropless import MoE
from dropless.ops.replay import checkpoint_state, remember

D, F = 8, 6


def _grads(moe: MoE, x_TD, g_TD, *, ckpt: bool, perturb=None):
    """Gradients of sum(moe(x) * g) w.r.t. x and every parameter; `perturb(moe)` runs
    between the forward and the backward (so before the recompute)."""
    x = x_TD.clone().requires_grad_(True)

    def f(x):
        return moe(x)[0]

    y = checkpoint(f, x, use_reentrant=False) if ckpt else f(x)
    if perturb is not None:
        with torch.no_grad():
            perturb(moe)
    (y * g_TD).sum().backward()
    return {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}


def _assert_equal(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


def _differs(got, want) -> bool:
    return any(not torch.allclose(got[n], want[n], rtol=1e-9, atol=1e-12) for n in want)


def _drifts(moe, x, g, perturb, want) -> bool:
    """Without replay a recompute that routes elsewhere either saves tensors of other
    shapes (each expert's kept h has its token count as rows; torch's checkpoint then
    refuses) or, where the counts agree, gives other gradients."""
    try:
        got = _grads(moe, x, g, ckpt=True, perturb=perturb)
    except CheckpointError as e:
        return "different metadata" in str(e)
    return _differs(got, want)


def _layer(E, K, **kw):
    torch.manual_seed(0)
    return MoE(D, F, E, K, dtype=torch.float64, **kw)


CASES = {  # (T, E, K, bias in the forward, bias in the recompute)
    "E5_K2": (16, 5, 2, None, None),
    "T1": (1, 5, 2, None, None),
    "E_not_pow2_K3": (12, 6, 3, None, None),
    "all_tokens_on_one_expert": (10, 5, 1, (0, 10.0), (3, 20.0)),
    "k_equals_E": (7, 3, 3, None, None),
}


def _set_bias(moe, spec):
    if spec is None:
        moe.router.expert_bias.copy_(torch.randn(moe.num_experts, dtype=torch.float32) * 2.0)
    else:
        moe.router.expert_bias.zero_()
        moe.router.expert_bias[spec[0]] = spec[1]


@pytest.mark.parametrize("case", CASES)
def test_expert_bias_changed_before_recompute(case, monkeypatch):
    T, E, K, fwd_bias, rec_bias = CASES[case]
    moe = _layer(E, K, expert_bias=True)
    with torch.no_grad():
        if fwd_bias is not None:
            _set_bias(moe, fwd_bias)
    x, g = torch.randn(T, D, dtype=torch.float64), torch.randn(T, D, dtype=torch.float64)
    want = _grads(copy.deepcopy(moe), x, g, ckpt=False)
    _assert_equal(_grads(copy.deepcopy(moe), x, g, ckpt=True), want)

    def perturb(m):
        torch.manual_seed(1)
        _set_bias(m, rec_bias)

    _assert_equal(_grads(copy.deepcopy(moe), x, g, ckpt=True, perturb=perturb), want)
    if K < E:  # the test can fail: without replay the recompute picks other experts
        monkeypatch.setattr(moe_mod, "routing_replay", lambda owner: contextlib.nullcontext())
        assert _drifts(copy.deepcopy(moe), x, g, perturb, want)


class _ForceTopK(TorchFunctionMode):
    """Test reference: every top-k returns the given indices (values gathered)."""

    def __init__(self, ids_TK):
        super().__init__()
        self.ids_TK = ids_TK

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.topk, torch.Tensor.topk):
            x = args[0]
            return torch.return_types.topk((x.gather(-1, self.ids_TK), self.ids_TK))
        return func(*args, **(kwargs or {}))


def test_router_weight_changed_before_recompute(monkeypatch):
    T, E, K = 16, 6, 2
    moe = _layer(E, K)
    x, g = torch.randn(T, D, dtype=torch.float64), torch.randn(T, D, dtype=torch.float64)
    new_w = torch.randn(E, D, dtype=torch.float64)
    ids_TK = moe.router(x).ids_TK

    # reference: no checkpointing, the new router weight, the forward's choice of experts
    ref = copy.deepcopy(moe)
    with torch.no_grad():
        ref.router.weight.copy_(new_w)
    assert not torch.equal(ref.router(x).ids_TK, ids_TK)  # the new weight routes elsewhere
    with _ForceTopK(ids_TK):
        want = _grads(ref, x, g, ckpt=False)

    def perturb(m):
        m.router.weight.copy_(new_w)

    _assert_equal(_grads(copy.deepcopy(moe), x, g, ckpt=True, perturb=perturb), want)
    monkeypatch.setattr(moe_mod, "routing_replay", lambda owner: contextlib.nullcontext())
    assert _drifts(copy.deepcopy(moe), x, g, perturb, want)


def test_nothing_recorded_outside_checkpointing():
    calls = []
    assert checkpoint_state() is None
    assert remember("k", lambda: calls.append(1) or 5) == 5
    assert remember("k", lambda: calls.append(1) or 6) == 6
    assert calls == [1, 1]


def test_remember_skips_compute_in_recompute():
    calls = []

    def f(x):
        n = remember("count", lambda: calls.append(1) or len(calls))
        return x * n

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = checkpoint(f, x, use_reentrant=False)
    y.sum().backward()
    assert calls == [1]  # computed in the forward only
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_second_backward_with_retain_graph_replays_again():
    moe = _layer(5, 2, expert_bias=True)
    x = torch.randn(16, D, dtype=torch.float64, requires_grad=True)
    want = _grads(
        copy.deepcopy(moe), x.detach(), torch.ones(16, D, dtype=torch.float64), ckpt=False
    )
    y = checkpoint(lambda v: moe(v)[0], x, use_reentrant=False)
    with torch.no_grad():
        moe.router.expert_bias.add_(torch.randn(5) * 5.0)
    y.sum().backward(retain_graph=True)  # each backward recomputes, each replays the forward
    first = x.grad.clone()
    x.grad = None
    y.sum().backward()
    torch.testing.assert_close(first, want["x"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, want["x"], rtol=1e-12, atol=1e-12)
