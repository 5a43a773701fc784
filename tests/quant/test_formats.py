"""FP8 / MXFP8 quantizers against the pure-torch specification, bit for bit."""

# R rows, N columns, S rows in expert groups

from __future__ import annotations

import math

import pytest
import torch

from dropless.ops.quantize import reference as ref
from dropless.quant import formats as fm
from dropless.quant.gemm import _History
from dropless.quant.recipe import DelayedScaling

FMTS = ["e4m3", "e5m2"]


def _bits(values_f32: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp8 bit patterns of values that are exactly representable (NaN -> 0x7F)."""
    v = torch.where(torch.isnan(values_f32), torch.full_like(values_f32, math.nan), values_f32)
    return v.to(fm.FP8_DTYPES[fmt]).view(torch.uint8)


def _assert_fp8_equal(q: torch.Tensor, ref_vals: torch.Tensor, fmt: str) -> None:
    qf = q.float()
    nan = torch.isnan(ref_vals)
    assert torch.equal(torch.isnan(qf), nan), "NaN positions differ"
    assert torch.equal(q.view(torch.uint8)[~nan], _bits(ref_vals, fmt)[~nan])


def _mixed(fmt: str, n: int = 4096, seed: int = 0) -> torch.Tensor:
    """Gaussian values spread over the whole range of the format, subnormals included."""
    g = torch.Generator().manual_seed(seed)
    emin, emax = (-10, 10) if fmt == "e4m3" else (-18, 17)
    mag = torch.pow(2.0, torch.randint(emin, emax, (n,), generator=g).float())
    return torch.randn(n, generator=g) * mag


@pytest.mark.parametrize("fmt", FMTS)
def test_cast_random_bitexact(fmt):
    x = _mixed(fmt)
    _assert_fp8_equal(fm.cast_fp8(x, fmt), ref.fp8_cast_reference(x, fmt), fmt)


EDGE = {
    "at_max": lambda m: [m, -m],
    "above_max_saturates": lambda m: [m * 1.01, -m * 1.5, m * 1e6, 3.0e38],
    "inf_saturates": lambda m: [math.inf, -math.inf],
    "nan_stays_nan": lambda m: [math.nan, 1.0],
    "signed_zero": lambda m: [0.0, -0.0],
    "ties_to_even": lambda m: [1.0625, 1.1875, 1.03125, 1.09375, -1.0625],
    "subnormals": lambda m: [
        2.0**-9,
        2.0**-10,
        3 * 2.0**-11,
        2.0**-7 + 2.0**-9,
        2.0**-16,
        2.0**-17,
        5 * 2.0**-18,
    ],
}


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", list(EDGE))
def test_cast_edge_cases(fmt, case):
    x = torch.tensor(EDGE[case](fm.FP8_MAX[fmt]), dtype=torch.float32)
    q = fm.cast_fp8(x, fmt)
    _assert_fp8_equal(q, ref.fp8_cast_reference(x, fmt), fmt)
    if case in ("above_max_saturates", "inf_saturates"):
        assert torch.equal(q.float().abs(), torch.full_like(x, fm.FP8_MAX[fmt]))
    if case == "signed_zero":
        assert q.view(torch.uint8).tolist() == [0, 0x80]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(
    "case", ["gaussian", "all_zero", "with_inf", "with_nan", "margin_2", "tiny_amax"]
)
def test_current_scaling_bitexact(fmt, case):
    x = torch.randn(7, 33, generator=torch.Generator().manual_seed(1))
    margin = 2 if case == "margin_2" else 0
    if case == "all_zero":
        x.zero_()
    if case == "with_inf":
        x[2, 3] = -math.inf
    if case == "with_nan":
        x[4, 4] = math.nan
    if case == "tiny_amax":
        x = x * 1e-30
    q = fm.quantize_current(x, fmt, margin=margin)
    scale = ref.current_scale_reference(x, fmt, margin)
    assert q.scale.item() == scale
    if case in ("all_zero", "with_inf", "with_nan"):
        assert scale == 1.0  # defined: no usable amax -> scale 1
    _assert_fp8_equal(q.data, ref.quantize_scaled_reference(x, fmt, torch.tensor(scale)), fmt)


def test_row_scaling_bitexact():
    x = torch.randn(6, 40) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[3] = 0.0
    q = fm.quantize_current(x, "e4m3", dims=1)
    for r in range(6):
        s = ref.current_scale_reference(x[r], "e4m3")
        assert q.scale[r, 0].item() == s
        _assert_fp8_equal(
            q.data[r], ref.quantize_scaled_reference(x[r], "e4m3", torch.tensor(s)), "e4m3"
        )


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_history(algo):
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=algo, margin=1)
    st = _History(recipe.amax_history_len, torch.zeros(()))
    amaxes = [4.0, 1.0, 2.0, 0.0, math.inf, 8.0]
    used, hist = [], []
    expect_scale = 1.0  # first call: no history yet
    for a in amaxes:
        used.append(st.use_and_update(torch.tensor(a), recipe, "e4m3").item())
        hist = ([a] + hist)[:2]
        window = max(hist) if algo == "max" else hist[0]
        ok = window > 0 and math.isfinite(window)
        expected_next = (448.0 / window) / 2 if ok else None
        assert used[-1] == pytest.approx(expect_scale, rel=1e-7)
        expect_scale = expected_next if expected_next is not None else expect_scale


# --- MXFP8 ------------------------------------------------------------------------------

MX_EDGE = {
    "all_zero_block": lambda x: x[:, :32].zero_(),
    "at_and_above_max": lambda x: x[0, :3].copy_(torch.tensor([448.0, 460.0, 900.0])),
    "power_of_two_amax": lambda x: (x[1].clamp_(-1, 1), x[1, 5].fill_(2.0), x[2, 40].fill_(-256.0)),
    "subnormal_elements": lambda x: x[2, 32:64].mul_(2.0**-20).__setitem__(0, 1.0),
    "tiny_block_amax": lambda x: x[3, :32].mul_(1e-38),
    "nan_block": lambda x: x[0, 40].fill_(math.nan),
    "inf_block": lambda x: x[1, 70].fill_(-math.inf),
    "rceil_boundary": lambda x: x[2, :2].copy_(torch.tensor([448.0 * 2, 449.0 * 2])),
}


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("case", ["random_N_not_multiple_of_32", *MX_EDGE])
def test_mx_rowwise_bitexact(rule, case):
    x = torch.randn(4, 80, generator=torch.Generator().manual_seed(3)) * 3
    if case in MX_EDGE:
        MX_EDGE[case](x)
    q = fm.quantize_mx(x, 1, scale_rule=rule)
    vals, exps = ref.mx_quantize_reference(x, "e4m3", rule)
    assert q.data.shape == (4, 96) and q.scale_inv.shape == (4, 3)  # padded to whole blocks
    _assert_fp8_equal(q.data, vals, "e4m3")
    bits = q.scale_inv.view(torch.uint8).long()
    assert torch.equal(bits, torch.where(exps == 255, exps, exps + 127))
    if case == "nan_block" or case == "inf_block":
        bad = bits == 255
        assert int(bad.sum()) == 1 and bool(
            torch.isnan(q.dequantize()[bad.repeat_interleave(32, 1)[:, :80]]).all()
        )
    if case == "all_zero_block":
        assert (bits[:, 0] == 0).all()  # scale 2^-127
    if case == "power_of_two_amax":
        assert bits[1, 0].item() - 127 == 1 - 8 and bits[2, 1].item() - 127 == 8 - 8


def test_mx_e5m2_and_columns():
    x = torch.randn(70, 5) * 100
    q = fm.quantize_mx(x, 0, fmt="e5m2")  # blocks along dim 0 (the columns)
    vals, exps = ref.mx_quantize_reference(x.t(), "e5m2", "floor")
    _assert_fp8_equal(q.data, vals, "e5m2")
    torch.testing.assert_close(
        q.dequantize(),
        (vals.view(5, 3, 32) * torch.pow(2.0, exps.float()).unsqueeze(-1)).view(5, 96)[:, :70].t(),
    )


@pytest.mark.parametrize("counts", [[5, 33, 64, 1], [0, 40, 0, 3], [32, 32], [0, 0]])
def test_mx_groups_uneven_bitexact(counts):
    N = 6
    x = torch.randn(sum(counts), N) * 4
    q = fm.quantize_mx_groups(x, counts)
    vals, exps = ref.mx_groups_reference(x, counts)
    S_pad = sum(-(-c // 32) * 32 for c in counts)
    assert q.data.shape == (S_pad, N) and q.scale_inv.shape == (S_pad // 32, N)
    _assert_fp8_equal(q.data, vals, "e4m3")
    assert torch.equal(q.scale_inv.view(torch.uint8).long(), exps + 127)
    # each group starts on a block boundary: the padded rows are zeros
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + -(-c // 32) * 32)
    for e, c in enumerate(counts):
        assert torch.equal(
            q.rows_S[sum(counts[:e]) : sum(counts[: e + 1])], torch.arange(starts[e], starts[e] + c)
        )
    deq = q.dequantize()
    assert deq.shape == x.shape
    torch.testing.assert_close(
        deq,
        (vals.view(-1, 32, N) * torch.pow(2.0, exps.float()).unsqueeze(1)).view(-1, N)[q.rows_S],
    )


# --- round trip ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
def test_round_trip_per_tensor(fmt):
    mbits, emin = (3, -6) if fmt == "e4m3" else (2, -14)
    x = torch.randn(64, 64) * 5
    q = fm.quantize_current(x, fmt)
    err = (q.dequantize() - x).abs()
    # half an ulp of the element, or half the subnormal quantum, mapped back by the scale
    bound = torch.maximum(
        x.abs() * 2.0 ** -(mbits + 1), 2.0 ** (emin - mbits - 1) / q.scale.expand_as(x)
    )
    assert bool((err <= bound * (1 + 1e-6)).all())


@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_round_trip_mx(rule):
    x = torch.randn(16, 96) * torch.logspace(-4, 4, 16).unsqueeze(1)
    q = fm.quantize_mx(x, 1, scale_rule=rule)
    X = q.scale_inv.float().repeat_interleave(32, 1)
    err = (q.dequantize() - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, 2.0**-10 * X)
    saturated = x.abs() > 448 * X
    if rule == "rceil":
        assert not bool(saturated.any())
    assert bool((err[~saturated] <= bound[~saturated]).all())
    # floor: a saturated value is clamped to +-448 X, which is within 1/8 of it (amax < 512 X)
    assert bool((q.dequantize()[saturated].abs() == (448 * X)[saturated]).all())
    assert bool((err[saturated] <= x.abs()[saturated] / 8).all())
