"""The FP8 weight-gradient GEMM (torch._scaled_grouped_mm 2D x 2D, grouped along the
rows) checked on CPU: every call obeys CUDA's rules (torch's own meta kernel of the op
runs on meta copies of the operands) and, with a reference of what the op computes, it
equals the emulated GEMM on the same FP8 operands up to the bf16 rounding of the output,
at the grouping edge cases; the dispatch takes it only for E4M3 operands with column
scales on a device that passed the probe."""

# S rows, M / N columns, E experts (groups)

from __future__ import annotations

import pytest
import torch

from dropless.quant import formats
from dropless.quant import fp8_wgrad as fw
from dropless.quant import gemm as qgemm


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _spy(monkeypatch):
    calls = []

    def scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, **kw):
        # CUDA's rules: torch's meta kernel of the op on meta copies of the operands
        real(_meta(a), _meta(b), _meta(scale_a), _meta(scale_b), offs=_meta(offs),
             out_dtype=out_dtype)  # fmt: skip
        calls.append((a.shape, b.shape, offs.tolist()))
        M, N = a.shape[0], b.shape[1]
        outs, lo = [], 0
        for e, hi in enumerate(offs.tolist()):
            ae = a[:, lo:hi].float() * scale_a[e * M : (e + 1) * M, None]
            be = b[lo:hi].float() * scale_b[e * N : (e + 1) * N][None, :]
            outs.append(ae @ be)
            lo = hi
        return torch.stack(outs).to(out_dtype)

    real = torch._scaled_grouped_mm
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm)
    return calls


CASES = {
    "uneven_with_empty": [5, 0, 33, 32, 1],
    "all_rows_one_group": [0, 48, 0],
    "one_row": [0, 1],
    "e_not_power_of_two": [7, 9, 3, 16, 2, 11, 5],
    "no_rows": [0, 0, 0],
}


@pytest.mark.parametrize("device_counts", [False, True], ids=["host_counts", "device_counts"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tensor_scale", [False, True], ids=["column_scales", "tensor_scale"])
def test_scaled_wgrad_equals_emulated(monkeypatch, case, device_counts, tensor_scale):
    calls = _spy(monkeypatch)
    counts = CASES[case]
    g = torch.Generator().manual_seed(len(counts))
    S, M, N = sum(counts), 32, 48
    a, b = torch.randn(S, M, generator=g), torch.randn(S, N, generator=g) * 3
    dims = None if tensor_scale else 0
    aq, bq = (formats.quantize_current(t, "e4m3", dims=dims) for t in (a, b))
    c = torch.tensor(counts) if device_counts else counts
    got = fw.scaled_wgrad(aq, bq, c, torch.float32)
    want = qgemm._emu_wgrad(aq, bq, counts, torch.float32)
    assert got.shape == (len(counts), M, N)
    # one bf16 rounding of each output; empty groups exactly zero
    torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=2**-8, atol=1e-5)
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.equal(got[e], torch.zeros(M, N))
    if S:
        (a_shape, b_shape, offs), *_ = calls
        assert all(o % 32 == 0 for o in offs) and a_shape[0] == M and b_shape[1] == N


def test_dispatch_needs_e4m3_column_scales_and_a_passed_probe(monkeypatch):
    calls = _spy(monkeypatch)
    counts = [8, 0, 24]
    a, b = torch.randn(32, 16), torch.randn(32, 32)
    aq = formats.quantize_current(a, "e4m3", dims=0)
    bq = formats.quantize_current(b, "e4m3", dims=0)
    assert not fw.fp8_wgrad_available(torch.device("cpu"))  # no sm90 here: no probe run
    qgemm._torch_wgrad(aq, bq, counts, torch.float32)
    assert calls == []
    monkeypatch.setitem(fw._WGRAD_OK, "cpu", True)
    y = qgemm._torch_wgrad(aq, bq, counts, torch.float32)
    assert len(calls) == 1
    torch.testing.assert_close(y, fw.scaled_wgrad(aq, bq, counts, torch.float32))
    e5m2 = formats.quantize_current(a, "e5m2", dims=0)  # HYBRID gradients: bf16 GEMM
    qgemm._torch_wgrad(e5m2, bq, counts, torch.float32)
    rows = formats.quantize_current(a, "e4m3", dims=1)  # row scales: not a wgrad operand
    qgemm._torch_wgrad(rows, bq, counts, torch.float32)
    assert len(calls) == 2


@pytest.mark.parametrize("broken", [False, True], ids=["right_op", "wrong_op"])
def test_probe_accepts_a_right_op_and_refuses_a_wrong_one(monkeypatch, broken):
    """The one-time probe (run here on CPU, its sync-debug switch stubbed): an op that
    computes the right thing passes; one that does not is refused, with a warning."""
    calls = _spy(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    if broken:
        right = torch._scaled_grouped_mm
        monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *a, **k: right(*a, **k).flip(1))
        with pytest.warns(UserWarning, match="differs from the emulated GEMM"):
            assert not fw._probe_wgrad(torch.device("cpu"))
    else:
        assert fw._probe_wgrad(torch.device("cpu"))
    assert len(calls) == 1
