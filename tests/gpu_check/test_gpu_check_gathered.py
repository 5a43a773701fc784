"""The "gathered" expert path's fused kernels (ops/expert_mlp/gather_gemm_kernels.py) in bf16 on
a GPU against an fp64 run of the reference MLP on the same device: forward, dx,
d gate_up, d down, d routing weights; with the weights read through TMA descriptors
(sm90+) and through plain loads; the routing-weight gradient bitwise repeatable; the
opt-in plan's tuning writing its cache. Marker `gpu`: skipped without CUDA (the
fp32 interpreter checks of the same kernels are tests/triton/test_triton_gather_gemm.py).
UNVERIFIED until run on a GPU.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# bf16: 8 mantissa bits, inputs and each GEMM's output rounded (h, a, y, dh): max-norm
# error a few 2^-8 against fp64
TOL = 3e-2
# name -> (T, E, K, D, F, token ids or None); D, F multiples of 8 (TMA's 16-byte strides)
CASES = {
    "uneven_E_not_pow2": (48, 6, 2, 64, 96, None),
    "expert_with_zero_tokens": (40, 6, 1, 64, 32, [[i % 3 * 2] for i in range(40)]),
    "all_tokens_on_one_expert": (33, 4, 1, 64, 32, [[2]] * 33),
    "T=1": (1, 4, 2, 64, 32, None),
    "k=E": (16, 3, 3, 64, 48, None),
    "rows_past_one_tile": (300, 4, 2, 128, 160, None),  # 128-row tiles, 64-row tails
}


def rel_err(got, want) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _fused_plan(x, gu, dn):
    """The plan with every fusable GEMM on the row-gathering kernels (no tuning)."""
    from dropless.ops.expert_mlp.plan import (
        FUSABLE,
        GEMMS,
        plan_expert_mlp,
        triton_gather_kernels,
    )
    from dropless.ops.specs import ActivationConfig

    plan = plan_expert_mlp(x, gu, dn, ActivationConfig(), path="grouped")
    gemms = tuple(None if g in FUSABLE else plan.gemm(g) for g in GEMMS)
    return dataclasses.replace(
        plan, gemms=gemms, kernels=triton_gather_kernels(), device_counts=True
    )


def _operands(T, E, K, D, F, ids, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    ids = torch.tensor(ids) if ids is not None else torch.rand(T, E, generator=gen).topk(K).indices
    w_TK = torch.rand(T, K, generator=gen)
    gu = torch.randn(E, 2 * F, D, generator=gen) / D**0.5
    dn = torch.randn(E, D, F, generator=gen) / F**0.5
    return x, ids, w_TK, gu, dn, torch.randn(T, D, generator=gen)


def _run(plan_fn, x, ids, w_TK, gu, dn, g, dtype):
    from dropless.ops import sort_by_expert
    from dropless.ops.expert_mlp.eager import run as fused_mlp

    leaves = [t.cuda().to(dtype).requires_grad_(True) for t in (x, w_TK, gu, dn)]
    plan = plan_fn(leaves[0], leaves[2], leaves[3])
    sp = sort_by_expert(ids.cuda(), gu.shape[0], host_counts=False)
    prob_S = leaves[1].reshape(-1).index_select(0, sp.pair_S)
    out = fused_mlp(
        leaves[0], prob_S, leaves[2], leaves[3], sp.counts_E, token_S=sp.token_S,
        slot_TK=sp.slot_TK, num_out=x.shape[0], plan=plan,
    )  # fmt: skip
    return [out, *torch.autograd.grad(out, leaves, g.cuda().to(dtype))]


def _reference(x, ids, w_TK, gu, dn, g):
    from dropless.ops.reference import expert_mlp_reference

    leaves = [t.cuda().double().requires_grad_(True) for t in (x, w_TK, gu, dn)]
    ref = expert_mlp_reference(leaves[0], ids.cuda(), *leaves[1:])
    return [ref, *torch.autograd.grad(ref, leaves, g.cuda().double())]


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "plain_loads"])
@pytest.mark.parametrize("name", list(CASES))
def test_gathered_bf16_against_fp64(name, tma, monkeypatch):
    from dropless.ops.expert_mlp import gather_gemm_kernels as gk

    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need compute capability 9.0 or newer")
    if not tma:
        monkeypatch.setattr(gk, "_use_tma", lambda w, interleaved: False)
    ops = _operands(*CASES[name])
    got = _run(_fused_plan, *ops, torch.bfloat16)
    want = _reference(*ops)
    for what, a, b in zip(["out", "dx", "d weights", "d gate_up", "d down"], got, want):
        assert a.dtype == torch.bfloat16, what
        assert rel_err(a, b) < TOL, (what, rel_err(a, b))


def test_the_routing_weight_gradient_is_bitwise_repeatable():
    ops = _operands(*CASES["rows_past_one_tile"])
    first = _run(_fused_plan, *ops, torch.bfloat16)
    again = _run(_fused_plan, *ops, torch.bfloat16)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_the_gathered_plan_tunes_once_and_caches(tmp_path, monkeypatch):
    from dropless.ops.expert_mlp import plan as planning
    from dropless.ops.specs import ActivationConfig

    path = tmp_path / "tuning.json"
    monkeypatch.setattr(planning, "_TUNER", [planning.GemmTuner(path)])
    monkeypatch.setattr(planning, "_PLANS", {})
    x, ids, w_TK, gu, dn, g = _operands(*CASES["rows_past_one_tile"])
    args = (x.cuda().bfloat16(), gu.cuda().bfloat16(), dn.cuda().bfloat16(), ActivationConfig())
    plan = planning.plan_expert_mlp(*args, path="gathered", tokens=ids.numel())
    choices = json.loads(path.read_text())["choices"]
    assert len(choices) == 4 and plan.kernels is not None
    picks = {k.split("|")[0]: v["pick"] for k, v in choices.items()}
    assert {g: (planning.FUSED if plan.gemm(g) is None else plan.gemm(g).name)
            for g in planning.FUSABLE} == picks  # fmt: skip
    out = _run(lambda *a: planning.plan_expert_mlp(*a, ActivationConfig(), path="gathered",
                                                   tokens=ids.numel()),
               x, ids, w_TK, gu, dn, g, torch.bfloat16)  # fmt: skip
    for what, a, b in zip(
        ["out", "dx", "d weights", "d gate_up", "d down"], out, _reference(x, ids, w_TK, gu, dn, g)
    ):
        assert rel_err(a, b) < TOL, what
