"""FP8 paths for GPUs, checked on CPU: weight quantization cached per optimizer step,
MXFP8 as bf16 GEMMs on dequantized values, the E5M2 fallback said once."""

# S rows, D in features, N out features, E experts

from __future__ import annotations

import warnings

import pytest
import torch

from dropless.ops import grouped_gemm
from dropless.quant import Float8CurrentScaling, MXFP8BlockScaling, autocast, formats
from dropless.quant import gemm as qgemm

COUNTS = [5, 0, 11, 16]
S, D, N = sum(COUNTS), 64, 32


def _count_quantizations(monkeypatch, name):
    calls = []
    real = getattr(qgemm, name)

    def spy(t, *a, **k):
        calls.append(tuple(t.shape))
        return real(t, *a, **k)

    monkeypatch.setattr(qgemm, name, spy)
    return calls


@pytest.mark.parametrize(
    "make, fn",
    [(MXFP8BlockScaling, "quantize_mx"), (Float8CurrentScaling, "quantize_scaled")],
    ids=["mxfp8", "current"],
)
def test_weight_quantized_once_per_step(monkeypatch, make, fn):
    calls = _count_quantizations(monkeypatch, fn)
    w = torch.randn(len(COUNTS), N, D, requires_grad=True)
    recipe = make()
    opt = torch.optim.SGD([w], lr=0.1)

    def step():
        calls.clear()
        for _ in range(3):  # three micro-batches of one step
            x = torch.randn(S, D, requires_grad=True)
            with autocast(recipe=recipe):
                grouped_gemm(x, w, COUNTS).square().sum().backward()
        return sum(1 for c in calls if c == tuple(w.shape))

    first = step()
    assert first == 2  # forward layout (along D) and dgrad layout (along N), once each
    opt.step()  # updates w in place: its version counter moves
    assert step() == 2
    with torch.no_grad():
        before = qgemm.quantize_operand(recipe, w, "w", 2, key=w)
        assert qgemm.quantize_operand(recipe, w, "w", 2, key=w) is before
        w.mul_(2)
        after = qgemm.quantize_operand(recipe, w, "w", 2, key=w)
    assert after is not before
    torch.testing.assert_close(after.dequantize(), 2 * before.dequantize())


@pytest.mark.parametrize("trans_b", [True, False])
def test_mxfp8_bf16_backend_equals_emulated(trans_b):
    """MX values (E4M3 x 2^k) are exact in bf16: the bf16 GEMM on them equals the fp32
    emulation up to the one rounding of each output to bf16."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S, D, generator=g)
    w = torch.randn(len(COUNTS), N, D, generator=g)
    if not trans_b:
        w = w.transpose(1, 2).contiguous()
    xq = formats.quantize_mx(x, 1)
    wq = formats.quantize_mx(w, 2 if trans_b else 1)
    assert torch.equal(xq.dequantize(torch.bfloat16).float(), xq.dequantize())  # exact
    emu = qgemm._emu_mm(xq, wq, COUNTS, trans_b, torch.float32)
    bf = qgemm._bf16_mm(xq, wq, torch.tensor(COUNTS), trans_b, torch.bfloat16)
    torch.testing.assert_close(bf.float(), emu.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)
    gq = formats.quantize_mx_groups(torch.randn(S, N, generator=g), COUNTS)
    xg = formats.quantize_mx_groups(x, COUNTS)
    ew = qgemm._emu_wgrad(gq, xg, COUNTS, torch.float32)
    bw = qgemm._bf16_wgrad(gq, xg, COUNTS, torch.bfloat16)
    torch.testing.assert_close(bw.float(), ew.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)


def test_mxfp8_auto_backend_is_emulated_on_cpu_and_torch_is_refused():
    x, w = torch.randn(S, D), torch.randn(len(COUNTS), N, D)
    assert qgemm.pick_backend(MXFP8BlockScaling(), x, w) == "emulated"
    with pytest.raises(ValueError, match="MXFP8"):
        qgemm.pick_backend(MXFP8BlockScaling(backend="torch"), x, w)


def test_e5m2_gradient_fallback_warns_once(monkeypatch):
    monkeypatch.setattr(qgemm, "_WARNED_E5M2", False)
    g = torch.randn(S, N)
    w = torch.randn(len(COUNTS), N, D)
    gq = formats.quantize_current(g, "e5m2")
    wq = formats.quantize_current(w, "e4m3")
    with pytest.warns(UserWarning, match="E4M3 operands only"):
        y = qgemm._torch_mm(gq, wq, COUNTS, False, torch.float32)
    torch.testing.assert_close(y, qgemm._emu_mm(gq, wq, COUNTS, False, torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qgemm._torch_mm(gq, wq, COUNTS, False, torch.float32)  # said once only


@pytest.mark.parametrize("counts", [[5, 0, 33, 32, 1], [0, 0, 0], [64]], ids=str)
def test_mx_groups_with_device_counts_equal_host_counts(counts):
    """Device counts (no host read): a static padded size, the same dequantized values."""
    x = torch.randn(sum(counts), 8)
    host = formats.quantize_mx_groups(x, counts)
    dev = formats.quantize_mx_groups(x, torch.tensor(counts))
    assert torch.equal(dev.dequantize(), host.dequantize())
    assert dev.data.shape[0] >= host.data.shape[0] and dev.data.shape[0] % 32 == 0


def _scaled_reference(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    """What _scaled_grouped_mm computes (2D x 3D): per group (a * sa) @ (b * sb)."""
    ends = offs.tolist()
    outs, lo = [], 0
    for e, hi in enumerate(ends):
        ae = a[lo:hi].float() * scale_a[lo:hi, None]
        outs.append(ae @ (b[e].float() * scale_b[e][None, :]))
        lo = hi
    return torch.cat(outs).to(out_dtype or torch.bfloat16)


@pytest.mark.parametrize("trans_b", [True, False])
def test_rowwise_fp8_calls_follow_scaled_grouped_mm_rules(monkeypatch, trans_b):
    """The row-wise FP8 backend's calls, checked on CPU against CUDA's rules (operand
    dtypes and layouts, scale shapes, int32 offsets), with device counts."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
    from cuda_rules import GemmSpy

    spy = GemmSpy(monkeypatch, scaled_impl=_scaled_reference)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(S, D, generator=g)
    w = torch.randn(len(COUNTS), N, D, generator=g)
    if not trans_b:
        w = w.transpose(1, 2).contiguous()
    xq = formats.quantize_current(x, "e4m3", dims=1)
    wq = formats.quantize_current(w, "e4m3", dims=2 if trans_b else 1)
    y = qgemm._torch_mm(xq, wq, torch.tensor(COUNTS), trans_b, torch.float32, fast_accum=True)
    assert len(spy.calls) == 1 and spy.bad() == [], spy.calls
    want = qgemm._emu_mm(xq, wq, COUNTS, trans_b, torch.float32)
    torch.testing.assert_close(y, want.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-3)


def test_pick_backend_checks_the_down_projections_inner_dim():
    """F = 8: 2F and D are multiples of 16, F is not: the FP8 down GEMM cannot run."""
    x, gate_up, down = torch.randn(4, 32), torch.randn(2, 16, 32), torch.randn(2, 32, 8)
    assert qgemm.fp8_aligned(x, gate_up) and not qgemm.fp8_aligned(x, gate_up, down)
    recipe = Float8CurrentScaling(fp8_format="E4M3", granularity="row", backend="torch")
    with pytest.raises(ValueError, match="multiples of 16"):
        qgemm.pick_backend(recipe, x, gate_up, down)
