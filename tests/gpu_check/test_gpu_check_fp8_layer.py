"""The FP8 GroupedMLP on a GPU against the same layer in bf16: SQNR of the output and of
every gradient, for every E4M3 recipe (each takes its fused SwiGLU-writes-FP8 kernel,
the row-op SwiGLU backward and combine, FP8 weights from the one weight cache) at the
routing edge cases, with real FP8 GEMMs (every dim a multiple of 16). Marker `gpu`:
skipped without CUDA (the CPU checks of the same code are tests/quant/test_fp8_*.py and
the interpreter checks tests/quant/test_triton_swiglu_current.py). UNVERIFIED until run
on a GPU.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# four quantized operands per pass, as tests/gpu_check/test_gpu_check_paths.py's floor
SQNR_FLOOR_DB = 17
D, F = 128, 96
# name -> (T, E, K, token ids or None)
CASES = {
    "uneven_E_not_pow2": (96, 6, 2, None),
    "expert_with_zero_tokens": (40, 6, 1, [[i % 3 * 2] for i in range(40)]),
    "all_tokens_on_one_expert": (33, 4, 1, [[2]] * 33),
    "T=1": (1, 4, 2, None),
    "k=E": (16, 3, 3, None),
}


def _recipes():
    from dropless.quant import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

    return {
        "current": lambda s: Float8CurrentScaling(fp8_format="E4M3", fp8_saved_activations=s),
        "current_row": lambda s: Float8CurrentScaling(
            fp8_format="E4M3", granularity="row", fp8_saved_activations=s
        ),
        "delayed": lambda s: DelayedScaling(fp8_format="E4M3", fp8_saved_activations=s),
        "mxfp8": lambda s: MXFP8BlockScaling(fp8_saved_activations=s),
    }


def sqnr_db(approx, exact) -> float:
    a, b = approx.detach().double(), exact.detach().double()
    return float(10 * torch.log10(b.pow(2).sum() / (a - b).pow(2).sum().clamp_min(1e-300)))


def _layer(case: str):
    T, E, K, ids = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    if ids is None:
        ids = torch.rand(T, E, generator=g, device=dev).topk(K, -1).indices
    else:
        ids = torch.tensor(ids, device=dev)
    x = torch.randn(T, D, generator=g, device=dev).to(bf).requires_grad_(True)
    w_TK = torch.rand(T, K, generator=g, device=dev).requires_grad_(True)
    gate_up = (torch.randn(E, 2 * F, D, generator=g, device=dev) / D**0.5).to(bf)
    down = (torch.randn(E, D, F, generator=g, device=dev) / F**0.5).to(bf)
    dy = torch.randn(T, D, generator=g, device=dev).to(bf)
    return ids, x, w_TK, gate_up.requires_grad_(True), down.requires_grad_(True), dy


def _step(ids, x, w_TK, gate_up, down, dy, recipe):
    import dropless
    from dropless.ops import expert_mlp

    for t in (x, w_TK, gate_up, down):
        t.grad = None
    with dropless.autocast(enabled=recipe is not None, recipe=recipe):
        y, _ = expert_mlp(x, ids, w_TK, gate_up, down)
    y.backward(dy)
    return [y, x.grad, w_TK.grad, gate_up.grad, down.grad]


# FP8 saved activations at one case per recipe (the GPU check's time is budgeted)
LAYER_RUNS = [(c, n, False) for c in CASES for n in _recipes()]
LAYER_RUNS += [("uneven_E_not_pow2", n, True) for n in _recipes()]


@pytest.mark.parametrize("case, name, saved", LAYER_RUNS)
def test_fp8_layer_sqnr_vs_bf16(case, name, saved):
    tensors = _layer(case)
    ref = _step(*tensors, None)
    recipe = _recipes()[name](saved)
    _step(*tensors, recipe)  # delayed: a first amax history
    got = _step(*tensors, recipe)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.isfinite(a).all(), i
        # a handful of values (T=1's two routing-weight gradients) is a noisy estimate
        floor = SQNR_FLOOR_DB if b.numel() >= 16 else SQNR_FLOOR_DB - 4
        if b.abs().max() > 0:
            assert sqnr_db(a, b) >= floor, (i, sqnr_db(a, b))


def test_cached_dgrad_weight_is_column_major():
    from dropless.quant import Float8CurrentScaling
    from dropless.quant.gemm import quantize_operand

    w = torch.nn.Parameter(torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16))
    recipe = Float8CurrentScaling(fp8_format="E4M3", granularity="row")
    q = quantize_operand(recipe, w, "w", 1, key=w)
    assert q.data.transpose(1, 2).is_contiguous()
    assert quantize_operand(recipe, w, "w", 1, key=w) is q


@pytest.mark.parametrize("counts", [[5, 0, 33, 32, 1], [0, 48, 0], [7, 9, 3, 16, 2, 11, 5]])
def test_fp8_wgrad_gemm_equals_emulated(counts):
    """The FP8 weight-gradient GEMM (torch._scaled_grouped_mm 2D x 2D) passes its probe
    on sm90+ and equals the emulated GEMM on the same operands up to bf16 rounding."""
    from dropless.quant import formats
    from dropless.quant import fp8_wgrad as fw
    from dropless.quant import gemm as qgemm

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FP8 grouped GEMMs need sm90+")
    assert fw.fp8_wgrad_available(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    S = sum(counts)
    a, b = (torch.randn(S, n, generator=g, device="cuda").bfloat16() for n in (64, 96))
    aq, bq = (formats.quantize_current(t, "e4m3", dims=0) for t in (a, b))
    got = fw.scaled_wgrad(aq, bq, torch.tensor(counts, device="cuda"), torch.float32)
    want = qgemm._emu_wgrad(aq, bq, counts, torch.float32)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3 * float(want.abs().max()))
