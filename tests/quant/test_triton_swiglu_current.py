"""The Triton SwiGLU x prob kernels that write FP8 under current scaling (one scale per
row, or per tensor), and the one dispatch of every E4M3 recipe to its kernel, against
the torch quantizers of the same fp32 values.

Run under TRITON_INTERPRET=1 in the interpreted child (tests/interpreted.py). act=False
cases (gate * up * prob: no exp) are compared bit for bit, scales included; with the
silu, exp may differ by an ulp between numpy and torch, so those cases allow a rare
one-code difference.
"""

# S rows, F expert hidden dim

from __future__ import annotations

import torch

from interpreted import interpreted_tests

CASES = [
    "rows_bitexact_one_tile",
    "rows_bitexact_walks_f",
    "rows_edge_values",
    "rows_margin",
    "tensor_bitexact",
    "tensor_nan",
    "every_recipe_with_silu",
    "no_rows",
]


def _h(S, F, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, 2 * F, generator=g) * scale, torch.rand(S, generator=g)


def _plain(h, prob):
    gate, up = h.chunk(2, dim=1)
    return gate * up if prob is None else gate * up * prob.unsqueeze(1)


def _same(q, ref):
    a, b = q.data.view(torch.uint8), ref.data.view(torch.uint8)
    assert torch.equal(a, b), int((a != b).sum())
    assert torch.equal(q.scale_inv, ref.scale_inv)
    assert torch.equal(q.scale, ref.scale)


def _close_codes(q, ref):
    diff = (q.data.view(torch.uint8).int() - ref.data.view(torch.uint8).int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01


def _recipes():
    from dropless.quant import (
        DelayedScaling,
        Float8CurrentScaling,
        MXFP8BlockScaling,
    )

    return {
        "current": lambda: Float8CurrentScaling(),
        "current_row": lambda: Float8CurrentScaling(granularity="row"),
        "delayed": lambda: DelayedScaling(),
        "mxfp8": lambda: MXFP8BlockScaling(),
    }


def check(case: str, device: str = "cpu") -> None:
    from dropless.quant import formats as fm
    from dropless.quant.gemm import quantize_operand
    from dropless.quant.mlp import _swiglu_f32, fused_swiglu_quant, swiglu_quant_rows

    if case in ("rows_bitexact_one_tile", "rows_bitexact_walks_f"):
        h, prob = _h(9, 80, 1)
        max_f = 128 if case == "rows_bitexact_one_tile" else 32  # 80 columns: 1 or 3 tiles
        q = swiglu_quant_rows(h.to(device), prob.to(device), act=False, block_s=4, max_f=max_f)
        _same(q, fm.quantize_current(_plain(h, prob), "e4m3", dims=1))
    elif case == "rows_edge_values":
        h, prob = _h(8, 40, 2)
        h[0] = 0.0  # all-zero row: scale 1
        h[1, 3] = float("nan")  # NaN: scale 1, the NaN stays
        h[2, 5] = float("inf")  # Inf: scale 1, saturates
        h[3] *= 1e-21  # amax ~1e-42 (subnormal): 448 / amax overflows, scale 1
        h[4, 0], h[4, 40] = 1e4, 1e4  # one large value per row: the rest rounds to zero
        prob[5] = 0.0
        q = swiglu_quant_rows(h.to(device), prob.to(device), act=False, max_f=16)
        _same(q, fm.quantize_current(_plain(h, prob), "e4m3", dims=1))
        assert float(q.scale[0]) == float(q.scale[1]) == float(q.scale[3]) == 1.0
    elif case == "rows_margin":
        h, _ = _h(6, 24, 3)
        q = swiglu_quant_rows(h.to(device), None, margin=3, act=False)
        _same(q, fm.quantize_current(_plain(h, None), "e4m3", dims=1, margin=3))
    elif case in ("tensor_bitexact", "tensor_nan"):
        recipe = _recipes()["current"]()
        h, prob = _h(21, 40, 4)
        if case == "tensor_nan":
            h[7, 2] = float("nan")
        q = fused_swiglu_quant(h.to(device), prob.to(device), recipe, None, act=False)
        _same(q, quantize_operand(recipe, _plain(h, prob), "x", 1))
        if case == "tensor_nan":
            assert float(q.scale) == 1.0
    elif case == "every_recipe_with_silu":
        h, prob = _h(19, 64, 5)
        for name, make in _recipes().items():
            key_a, key_b = torch.zeros(1), torch.zeros(1)  # delayed-scaling owners
            ra, rb = make(), make()
            for _ in range(2):  # delayed: the second call uses the first call's amax
                q = fused_swiglu_quant(h.to(device), prob.to(device), ra, key_a)
                ref = quantize_operand(rb, _swiglu_f32(h, prob), "x", 1, key=key_b)
            _close_codes(q, ref)
            if name != "mxfp8":
                torch.testing.assert_close(q.scale, ref.scale, rtol=1e-6, atol=0)
    elif case == "no_rows":
        h = torch.zeros(0, 64)
        for make in _recipes().values():
            q = fused_swiglu_quant(h.to(device), None, make(), torch.zeros(1))
            assert q.data.shape[0] == 0 and q.dequantize().shape == (0, 32)
    else:
        raise AssertionError(case)


test_interpreted, test_cuda = interpreted_tests(CASES, check)
