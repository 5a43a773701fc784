"""The FP8 GroupedMLP's memory-bound steps go through the registered row ops: the SwiGLU
backward (which also recomputes the activation the down weight gradient reads) and the
combines of the token path; checked against the MLP composed from the recipe's GEMMs
at the routing edge cases."""

# T tokens, S sorted pairs, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import dataclasses

import pytest
import torch

import dropless
from dropless.ops import sort_by_expert, swiglu
from dropless.ops.grouped_gemm import grouped_gemm
from dropless.ops.permute import row_ops
from dropless.quant import (
    DelayedScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    autocast,
    quantized_grouped_mlp,
)

D, F = 32, 48

RECIPES = {
    "current": Float8CurrentScaling,
    "current_row": lambda **k: Float8CurrentScaling(granularity="row", **k),
    "delayed": DelayedScaling,
    "mxfp8": MXFP8BlockScaling,
}


def _spy_row_ops(monkeypatch):
    """The eager row ops registered as the best implementation, counting calls."""
    calls: list[str] = []

    def count(name, fn):
        def wrapped(*a, **k):
            calls.append(name)
            return fn(*a, **k)

        return wrapped

    e = row_ops.EAGER
    spy = dataclasses.replace(
        e,
        name="spy",
        gather_sum=count("gather_sum", e.gather_sum),
        act_bwd=count("act_bwd", e.act_bwd),
        priority=100,
    )
    monkeypatch.setitem(row_ops._ROW_OPS, "spy", spy)
    return calls


def _weights(E, g):
    gate_up = (torch.randn(E, 2 * F, D, generator=g) / D**0.5).requires_grad_(True)
    down = (torch.randn(E, D, F, generator=g) / F**0.5).requires_grad_(True)
    return gate_up, down


def _run(fn, tensors, dy):
    for t in tensors:
        t.grad = None
    y = fn()
    y.backward(dy)
    return [y.detach()] + [t.grad.clone() for t in tensors]


def test_backward_and_combines_use_the_registered_row_ops(monkeypatch):
    calls = _spy_row_ops(monkeypatch)
    g = torch.Generator().manual_seed(0)
    T, K, E = 12, 2, 4
    x = torch.randn(T, D, generator=g, requires_grad=True)
    gate_up, down = _weights(E, g)
    sp = sort_by_expert(torch.rand(T, E, generator=g).topk(K, -1).indices, E)
    prob = torch.rand(T * K, generator=g)[sp.pair_S].requires_grad_(True)
    y = quantized_grouped_mlp(
        x, sp.counts, prob, gate_up, down, recipe=Float8CurrentScaling(granularity="row"),
        token_S=sp.token_S, slot_TK=sp.slot_TK, num_out=T,
    )  # fmt: skip
    assert calls == ["gather_sum"]  # the forward combine
    y.sum().backward()
    # one SwiGLU backward pass (with the recompute), one combine of dx
    assert sorted(calls) == ["act_bwd", "gather_sum", "gather_sum"]
    assert prob.grad is not None and torch.isfinite(prob.grad).all()


def _ids(case: str, g):
    """[T, K] expert ids and E for each routing edge case."""
    if case == "empty_expert":
        E, T, K = 5, 16, 2
        ids = torch.rand(T, E - 1, generator=g).topk(K, -1).indices  # expert 4 gets none
    elif case == "all_on_one_expert":
        E, T, K = 4, 9, 1
        ids = torch.full((T, K), 2)
    elif case == "one_token":
        E, T, K = 4, 1, 2
        ids = torch.tensor([[3, 0]])
    elif case == "k_equals_e":
        E, T, K = 3, 7, 3
        ids = torch.rand(T, E, generator=g).argsort(-1)
    else:  # E not a power of two, uneven loads
        E, T, K = 7, 23, 3
        ids = torch.rand(T, E, generator=g).topk(K, -1).indices
    return ids, E


CASES = ["empty_expert", "all_on_one_expert", "one_token", "k_equals_e", "e_not_power_of_two"]


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("case", CASES)
def test_token_path_equals_composed_recipe_gemms(name, case):
    """x_TD in, out_TD back (gather, GEMM, SwiGLU x prob + quantize, GEMM, combine in one
    Function) == permute -> recipe GEMM -> ops.swiglu -> recipe GEMM -> unpermute, forward
    and every gradient. Both quantize the same fp32 values with the same rules, so they
    differ only by fp32 summation order (1e-5)."""
    g = torch.Generator().manual_seed(CASES.index(case))
    ids, E = _ids(case, g)
    T, K = ids.shape
    x = torch.randn(T, D, generator=g, requires_grad=True)
    gate_up, down = _weights(E, g)
    w_TK = torch.rand(T, K, generator=g, requires_grad=True)
    dy = torch.randn(T, D, generator=g)
    sp = sort_by_expert(ids, E)

    def fused():
        prob = w_TK.reshape(-1)[sp.pair_S]
        with autocast(recipe=RECIPES[name]()):
            return quantized_grouped_mlp(
                x, sp.counts, prob, gate_up, down, recipe=dropless.quant.active_recipe(),
                token_S=sp.token_S, slot_TK=sp.slot_TK, num_out=T,
            )  # fmt: skip

    def composed():
        prob = w_TK.reshape(-1)[sp.pair_S]
        with autocast(recipe=RECIPES[name]()):
            h = grouped_gemm(dropless.ops.permute(x, sp), gate_up, sp.counts)
            y = grouped_gemm(swiglu(h, prob), down, sp.counts)
        return dropless.ops.unpermute(y, sp)

    tensors = [x, gate_up, down, w_TK]
    for a, b in zip(_run(fused, tensors, dy), _run(composed, tensors, dy)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["current_row", "mxfp8", "current"])
@pytest.mark.parametrize("dropped", [False, True], ids=["dropless", "capacity_dropped_pairs"])
def test_row_scaled_tokens_quantized_once_then_gathered(monkeypatch, name, dropped):
    """Row and MX scales depend on each row alone: the token path quantizes the T token
    rows (not the T*K gathered rows) and gathers bytes and scales, the same bytes as
    quantizing the gathered rows. A per-tensor scale depends on which rows are kept:
    dropless (every token gathered) it is the tokens' own; with dropped pairs that mode
    gathers first."""
    from dropless.quant import gemm as qgemm
    from dropless.quant import mlp as qmlp

    g = torch.Generator().manual_seed(7)
    T, K, E = 10, 3, 4
    x = torch.randn(T, D, generator=g) * 4
    sp = sort_by_expert(
        torch.rand(T, E, generator=g).topk(K, -1).indices, E,
        (torch.rand(T, K, generator=g) > 0.4) if dropped else None,
    )  # fmt: skip
    recipe = RECIPES[name]()
    got = qmlp._operand_rows(recipe, x, sp.token_S, "x", None, every_row=not dropped)
    want = qgemm.quantize_operand(recipe, x.index_select(0, sp.token_S), "x", 1)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale_inv.float(), want.scale_inv.float())
    rows = []
    real = qmlp.quantize_operand

    def spy(recipe, t, role, dim, **kw):
        if role == "x" and dim == 1:
            rows.append(t.shape[0])
        return real(recipe, t, role, dim, **kw)

    monkeypatch.setattr(qmlp, "quantize_operand", spy)
    gate_up, down = _weights(E, g)
    prob = torch.rand(sp.num_slots, generator=g)
    quantized_grouped_mlp(
        x, sp.counts, prob, gate_up, down, recipe=recipe, token_S=sp.token_S,
        slot_TK=sp.slot_TK, num_out=T,
    )  # fmt: skip
    assert rows[0] == (sp.num_slots if name == "current" and dropped else T)


def test_dgrad_outputs_stay_in_the_input_dtype_on_real_gemm_backends(monkeypatch):
    """The real FP8 GEMMs (and MXFP8's bf16 ones) round their output to bf16: the
    SwiGLU-input gradient is taken in that dtype, not copied to fp32 first."""
    from dropless.quant import gemm as qgemm
    from dropless.quant import mlp as qmlp

    dtypes = []
    mm, wgrad = qgemm.BACKENDS["bf16"]

    def spy(aq, bq, counts, trans_b, out_dtype, fast_accum=False):
        dtypes.append(out_dtype)
        return mm(aq, bq, counts, trans_b, out_dtype, fast_accum)

    monkeypatch.setitem(qgemm.BACKENDS, "bf16", (spy, wgrad))
    monkeypatch.setattr(qmlp, "pick_backend", lambda *a: "bf16")
    g = torch.Generator().manual_seed(3)
    counts = [3, 0, 5]
    x = torch.randn(8, D, generator=g).bfloat16().requires_grad_(True)
    gate_up, down = (t.detach().bfloat16().requires_grad_(True) for t in _weights(3, g))
    y = quantized_grouped_mlp(x, counts, None, gate_up, down, recipe=MXFP8BlockScaling())
    y.float().sum().backward()
    assert dtypes == [torch.bfloat16] * 4  # two forward GEMMs, two dgrad GEMMs
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()
