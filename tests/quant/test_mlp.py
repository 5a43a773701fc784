"""The fused GroupedMLP under a recipe, FP8 saved activations, and the MoE layer."""

# T tokens, S sorted pairs, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import pytest
import torch

import dropless
from dropless.bench.fp8 import saved_tensor_bytes
from dropless.ops import grouped_mlp, sort_by_expert, swiglu
from dropless.ops.grouped_gemm import grouped_gemm
from dropless.ops.grouped_gemm.eager import expand_bias
from dropless.quant import (
    DelayedScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    autocast,
    quantized_grouped_mlp,
)

COUNTS = [40, 0, 70, 17]
S, D, F, E = sum(COUNTS), 64, 48, len(COUNTS)

RECIPES = {
    "current": lambda **k: Float8CurrentScaling(**k),
    "current_row": lambda **k: Float8CurrentScaling(granularity="row", **k),
    "delayed": lambda **k: DelayedScaling(**k),
    "mxfp8": lambda **k: MXFP8BlockScaling(**k),
}


def sqnr_db(approx, exact) -> float:
    approx, exact = approx.detach().double(), exact.detach().double()
    return float(10 * torch.log10(exact.pow(2).sum() / (approx - exact).pow(2).sum()))


def _params(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    p = {
        "x": torch.randn(S, D, generator=g),
        "prob": torch.rand(S, generator=g),
        "gate_up": torch.randn(E, 2 * F, D, generator=g) / D**0.5,
        "down": torch.randn(E, D, F, generator=g) / F**0.5,
        "b1": torch.randn(E, 2 * F, generator=g) * 0.1 if bias else None,
        "b2": torch.randn(E, D, generator=g) * 0.1 if bias else None,
    }
    dy = torch.randn(S, D, generator=g)
    return {k: (v.requires_grad_(True) if v is not None else None) for k, v in p.items()}, dy


def _composed(p):
    h = grouped_gemm(p["x"], p["gate_up"], COUNTS, p["b1"])
    a = swiglu(h, p["prob"])
    y = grouped_gemm(a, p["down"], COUNTS)
    return y + expand_bias(p["b2"], COUNTS) * p["prob"].unsqueeze(1)


def _fused(p):
    return grouped_mlp(
        p["x"], COUNTS, p["prob"], p["gate_up"], p["down"], gate_up_bias=p["b1"], down_bias=p["b2"]
    )


def _grads(fn, p, dy, recipe):
    for v in p.values():
        if v is not None:
            v.grad = None
    with autocast(enabled=recipe is not None, recipe=recipe):
        y = fn(p)
    y.backward(dy)
    return [y.detach()] + [v.grad.clone() for v in p.values() if v is not None]


@pytest.mark.parametrize("name", list(RECIPES))
def test_fused_mlp_equals_composed_recipe_gemms(name):
    """SwiGLU x prob + quantization fused in one Function == the MLP composed from the
    recipe's grouped GEMMs and ops.swiglu, forward and every gradient."""
    p, dy = _params()
    fused = _grads(_fused, p, dy, RECIPES[name]())
    composed = _grads(_composed, p, dy, RECIPES[name]())
    for f, c in zip(fused, composed):
        torch.testing.assert_close(f, c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("fp8_saved", [False, True])
@pytest.mark.parametrize("dropped", [False, True], ids=["dropless", "capacity_dropped_pairs"])
def test_token_path_equals_sorted_rows_path(name, fp8_saved, dropped):
    """Given x_TD and the token indices, the MLP gathers and combines itself (keeping
    only x_TD): same result as permute -> MLP on x_SD -> unpermute."""
    g = torch.Generator().manual_seed(5)
    T, K = 40, 2
    x = torch.randn(T, D, generator=g, requires_grad=True)
    ids = torch.rand(T, E, generator=g).topk(K, -1).indices
    w_TK = torch.rand(T, K, generator=g)
    gate_up = (torch.randn(E, 2 * F, D, generator=g) / 8).requires_grad_(True)
    down = (torch.randn(E, D, F, generator=g) / 7).requires_grad_(True)
    dy = torch.randn(T, D, generator=g)
    keep = (torch.rand(T, K, generator=g) > 0.3) if dropped else None
    sp = sort_by_expert(ids, E, keep)
    assert (sp.num_dropped > 0) == dropped
    prob = w_TK.reshape(-1)[sp.pair_S]
    outs = []
    for path in ("rows", "tokens"):
        x.grad = gate_up.grad = down.grad = None
        recipe = RECIPES[name](fp8_saved_activations=fp8_saved)
        if path == "rows":
            y = dropless.ops.unpermute(
                quantized_grouped_mlp(
                    dropless.ops.permute(x, sp), sp.counts, prob, gate_up, down, recipe=recipe
                ),
                sp,
            )
        else:
            y = quantized_grouped_mlp(
                x,
                sp.counts,
                prob,
                gate_up,
                down,
                recipe=recipe,
                token_S=sp.token_S,
                slot_TK=sp.slot_TK,
                num_out=T,
            )
        y.backward(dy)
        outs.append([y.detach(), x.grad.clone(), gate_up.grad.clone(), down.grad.clone()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_saved_activations_numerics(name):
    """Forward is unchanged; gradients read h from FP8 and lose at most 2 dB of SQNR
    against fp32 (measured: 0.3-1.8 dB)."""
    p, dy = _params(1)
    exact = _grads(_fused, p, dy, None)
    plain = _grads(_fused, p, dy, RECIPES[name]())
    saved = _grads(_fused, p, dy, RECIPES[name](fp8_saved_activations=True))
    assert torch.equal(plain[0], saved[0])
    for s_, p_, e in zip(saved[1:], plain[1:], exact[1:]):
        if s_.shape == p["b2"].shape:  # the down bias gradient is not quantized
            torch.testing.assert_close(s_, e)
            continue
        assert sqnr_db(s_, e) >= sqnr_db(p_, e) - 2.0


@pytest.mark.parametrize("name", ["current_e4m3", "mxfp8"])
def test_mlp_sqnr_vs_fp32(name):
    """Two chained quantized GEMMs (four quantized operands per pass): >= 20 dB."""
    recipe = (
        Float8CurrentScaling(fp8_format="E4M3") if name == "current_e4m3" else MXFP8BlockScaling()
    )
    p, dy = _params(2)
    exact = _grads(_fused, p, dy, None)
    got = _grads(_fused, p, dy, recipe)
    for a, b in zip(got, exact):
        assert sqnr_db(a, b) >= 20


def test_fp8_saved_activations_memory_expert_mlp():
    """What the expert MLP keeps for backward, x_TD (the caller's) aside: <= 0.6x of the
    full-precision bf16 path's (its lean fused Function keeps h [S, 2F] in bf16)."""
    torch.manual_seed(0)
    T, K, D_, F_, E_ = 64, 4, 128, 96, 4
    x = torch.randn(T, D_, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.rand(T, E_).topk(K, -1).indices
    w_TK = torch.rand(T, K, dtype=torch.bfloat16)
    gate_up = torch.randn(E_, 2 * F_, D_, dtype=torch.bfloat16, requires_grad=True)
    down = torch.randn(E_, D_, F_, dtype=torch.bfloat16, requires_grad=True)
    exclude = [x, gate_up, down]
    base, _ = saved_tensor_bytes(
        lambda: dropless.ops.expert_mlp(x, ids, w_TK, gate_up, down)[0], exclude
    )
    sp = sort_by_expert(ids, E_)
    prob = w_TK.reshape(-1)[sp.pair_S]
    for recipe in (
        MXFP8BlockScaling(fp8_saved_activations=True),
        Float8CurrentScaling(fp8_saved_activations=True),
    ):
        n, y = saved_tensor_bytes(
            lambda r=recipe: quantized_grouped_mlp(
                x, sp.counts, prob, gate_up, down, recipe=r, token_S=sp.token_S, slot_TK=sp.slot_TK
            ),
            exclude,
        )
        assert n <= 0.6 * base, (recipe.kind, n, base)
        y.float().sum().backward()
        assert torch.isfinite(gate_up.grad.float()).all()


@pytest.mark.parametrize("dropped", [False, True])
def test_bias_grads_of_bf16_tokens_sum_in_the_bias_dtype(dropped):
    """bf16 tokens, fp32 weights, biases and probs under a recipe, on the token path: the
    engine adds the biases and sums their gradients in the biases' dtype; the down bias's
    is sum over each expert's kept pairs of g_out[token] * prob, not quantized."""
    g = torch.Generator().manual_seed(3)
    T, K = 24, 2
    x = torch.randn(T, D, generator=g).bfloat16().requires_grad_()
    gate_up = torch.randn(E, 2 * F, D, generator=g).mul_(0.1).requires_grad_()
    down = torch.randn(E, D, F, generator=g).mul_(0.1).requires_grad_()
    b1, b2 = (torch.randn(E, n, generator=g).mul_(0.1).requires_grad_() for n in (2 * F, D))
    ids = torch.randint(0, E, (T, K), generator=g)
    keep = torch.rand(T, K, generator=g) > 0.3 if dropped else None
    sp = sort_by_expert(ids, E, keep)
    prob = torch.rand(sp.token_S.numel(), generator=g)
    tokens = dict(token_S=sp.token_S, slot_TK=sp.slot_TK, gate_up_bias=b1, down_bias=b2)
    y = quantized_grouped_mlp(
        x, sp.counts, prob, gate_up, down, recipe=MXFP8BlockScaling(), **tokens
    )
    g_out = torch.randn(y.shape, generator=g).to(y.dtype)
    y.backward(g_out)
    assert (
        y.dtype == x.grad.dtype == torch.bfloat16
        and b1.grad.dtype == b2.grad.dtype == torch.float32
    )
    rows = g_out.float()[sp.token_S] * prob.unsqueeze(1)
    want = torch.zeros(E, D).index_add_(0, expand_bias(torch.arange(E), sp.counts), rows)
    torch.testing.assert_close(b2.grad, want)
    assert torch.isfinite(b1.grad).all() and b1.grad.abs().sum() > 0


@pytest.mark.parametrize("name", list(RECIPES))
def test_moe_layer_under_autocast(name):
    torch.manual_seed(0)
    moe = dropless.MoE(D, F, E, 2, bias=True)
    x = torch.randn(2, 24, D)
    ref, ref_aux = moe(x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    with autocast(recipe=RECIPES[name](fp8_saved_activations=True)):
        out, aux = moe(x)
    out.sum().backward()
    assert out.shape == ref.shape and 20 <= sqnr_db(out, ref) < 100  # quantized, and close
    assert torch.equal(aux.tokens_per_expert, ref_aux.tokens_per_expert)
    for g, r in zip((p.grad for p in moe.parameters()), ref_grads):
        assert g is not None and sqnr_db(g, r) >= 15


def test_gpt_oss_activation_is_composed_under_recipe():
    torch.manual_seed(0)
    moe = dropless.MoE(D, F, E, 2, bias=True, activation="gpt_oss")
    x = torch.randn(16, D)
    ref, _ = moe(x)
    with autocast(recipe=MXFP8BlockScaling()):
        out, _ = moe(x)
    out.sum().backward()
    assert sqnr_db(out, ref) >= 20 and moe.experts.gate_up_proj.grad is not None


def test_a_composed_activation_runs_the_recipe_it_is_given():
    """quantized_grouped_mlp(recipe=r) with an activation the slot does not fuse composes
    r's grouped GEMMs whether or not dropless.autocast is active (the composed GEMMs read
    the active recipe: without autocast they ran at full precision)."""
    from dropless.ops.specs import ActivationConfig

    p, dy = _params()
    gelu = ActivationConfig("gelu", gated=True)
    args = (p["x"], COUNTS, p["prob"], p["gate_up"], p["down"])
    kw = dict(gate_up_bias=p["b1"], down_bias=p["b2"], activation=gelu)
    exact = grouped_mlp(*args, **kw)
    given = quantized_grouped_mlp(*args, **kw, recipe=MXFP8BlockScaling())
    with autocast(recipe=MXFP8BlockScaling()):
        active = quantized_grouped_mlp(*args, **kw, recipe=MXFP8BlockScaling())
    torch.testing.assert_close(given, active, rtol=0, atol=0)
    assert 20 <= sqnr_db(given, exact) < 60  # quantized, not the full-precision result
    given.backward(dy)
    assert p["gate_up"].grad is not None


def test_mlp_needs_a_recipe_and_matching_indices():
    p, _ = _params()
    with pytest.raises(ValueError, match="recipe"):
        quantized_grouped_mlp(p["x"], COUNTS, p["prob"], p["gate_up"], p["down"])
    with pytest.raises(ValueError, match="token_S and slot_TK"):
        quantized_grouped_mlp(
            p["x"],
            COUNTS,
            p["prob"],
            p["gate_up"],
            p["down"],
            recipe=MXFP8BlockScaling(),
            token_S=torch.arange(S),
        )


def test_bench_fp8_cli_smoke(capsys):
    from dropless.cli.main import main

    tiny = ["--T", "64", "--D", "64", "--F", "32", "--E", "4", "--K", "2", "--no-history"]
    assert main(["bench", "fp8", *tiny]) == 0
    out = capsys.readouterr().out
    assert "| mxfp8 |" in out and "| bf16 | " in out
    assert main(["bench", "fp8", "--variants", "mxfp8", "--no-history"]) == 2
