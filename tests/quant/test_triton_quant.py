"""The one-pass Triton FP8 casts (`ops/quantize/triton_quant.py`) against the torch forms.

Under TRITON_INTERPRET=1 in the interpreted child process (tests/interpreted.py, the
variable set before triton is imported), every case compares bytes: the kernels must give exactly
what `formats.py`'s torch path gives (on CPU, where `_kernels` returns None). The
"dispatch" cases route `formats.py` through the kernels for CPU tensors and check that
a MoE step under each recipe is bit-identical. On a GPU (marker `gpu`) the same
comparisons run compiled against torch's CUDA casts.
"""

# M rows, N columns

from __future__ import annotations

import os

import pytest
import torch

from interpreted import interpreted_tests

CASES = [
    "e4m3_decode_exhaustive",
    "scale_cast_scalar_row_col",
    "scale_cast_edges_and_strides",
    "dequant_scaled",
    "mx_quantize_floor",
    "mx_quantize_rceil_transposed",
    "mx_dequant",
    "mx_3d_weights",
    "mx_groups",
    "int64_offsets",
    "mx_block_is_formats_block",
    "dispatch_moe_steps",
]


def _same(a, b):
    a8, b8 = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(a8, b8), f"{int((a8 != b8).sum())} of {a8.numel()} bytes differ"


def _same_values(a, b):
    """Equal values (NaN where NaN). bf16 under the interpreter: within one bf16 step,
    since its fp32 -> bf16 conversion truncates where the GPU rounds to nearest
    (subnormal results: within the smallest normal)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(a.isnan(), b.isnan())
    a, b = a.nan_to_num(), b.nan_to_num()
    if a.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=2**-126)
    else:
        assert torch.equal(a, b)


def _x(M, N, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, N, generator=g) * torch.logspace(-3, 3, N).unsqueeze(0)
    return x.to(dtype).to(device)


def _edges(x):
    x = x.clone()
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    x[1, 0] = -float("nan")
    x[2, :] = 0.0
    x[3, :3] = torch.tensor([1e-30, -1e-41, 3e38])
    return x


def _torch_cast(x, scale):
    return (x.float() * scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def check(case: str, device: str = "cpu") -> None:
    from dropless.ops.quantize import triton_quant as tq
    from dropless.quant import formats as fm

    if case == "e4m3_decode_exhaustive":
        q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(8, 32)
        q = q.to(device)
        one = torch.tensor(1.0, device=device)
        _same_values(tq.dequant_scaled(q, one, torch.float32), q.float())
    elif case == "scale_cast_scalar_row_col":
        for dtype in (torch.float32, torch.bfloat16):
            x = _x(37, 70, 1, dtype, device)
            amax_r = x.float().abs().amax(1, keepdim=True)
            amax_c = x.float().abs().amax(0, keepdim=True)
            for scale in (torch.tensor(3.7), 448.0 / amax_r, 448.0 / amax_c):
                scale = scale.to(device)
                _same(tq.scale_cast(x, scale, block=(16, 32)), _torch_cast(x, scale))
    elif case == "scale_cast_edges_and_strides":
        x = _edges(_x(40, 48, 2, device=device))
        for view in (x, x.t(), x[::2, 5:]):
            scale = torch.tensor(1000.0, device=device)
            _same(tq.scale_cast(view, scale, block=(16, 32)), _torch_cast(view, scale))
    elif case == "dequant_scaled":
        x = _edges(_x(33, 40, 3, device=device))
        s = (448.0 / x.abs().nan_to_num(0, 0, 0).amax(1, keepdim=True).clamp_min(1e-3)).float()
        q = _torch_cast(x, s)
        for dtype in (torch.float32, torch.bfloat16):
            want = (q.float() * s.reciprocal()).to(dtype)
            _same_values(tq.dequant_scaled(q, s.reciprocal(), dtype, block=(16, 32)), want)
            _same_values(
                tq.dequant_scaled(q.t(), s.reciprocal().t(), dtype, block=(16, 32)), want.t()
            )
    elif case in ("mx_quantize_floor", "mx_quantize_rceil_transposed"):
        rule = "floor" if case == "mx_quantize_floor" else "rceil"
        x = _edges(_x(37, 80, 4, device=device))  # 80: a partial last block
        x[4, 40:64] *= 1e-40  # a block of subnormals
        x[5, 0] = 500.0  # saturates under floor
        for view in (x, x.t()) if rule == "rceil" else (x,):
            q, s = tq.mx_quantize(view, rule, block_m=16)
            ref = fm.quantize_mx(view.cpu(), 1, scale_rule=rule)
            _same(q, ref.data.to(device))
            _same(s, ref.scale_inv.to(device))
    elif case == "mx_dequant":
        x = _edges(_x(21, 70, 5, device=device))
        ref = fm.quantize_mx(x.cpu(), 1)
        s = ref.scale_inv.view(torch.uint8).clone()
        s[6, 0], s[7, 1] = 0, 255  # 2**-127 and the NaN scale
        s = s.view(torch.float8_e8m0fnu)
        want = fm._mx_dequant_last(ref.data, s)[:, :70]
        for dtype in (torch.float32, torch.bfloat16):
            got = tq.mx_dequant(ref.data.to(device), s.to(device), 70, dtype, block=(16, 32))
            _same_values(got.cpu(), want.to(dtype))
    elif case == "mx_3d_weights":
        # a grouped weight [E, N, K]: blocks along K (in place) and along N (moved last)
        w = _x(3 * 40, 48, 8, device=device).view(3, 40, 48)
        real = fm._kernels
        try:
            for dim in (2, 1):
                fm._kernels = lambda t, fmt="e4m3": tq if fmt == "e4m3" else None
                got = fm.quantize_mx(w, dim)
                got_x = got.dequantize(torch.float32)
                fm._kernels = lambda t, fmt="e4m3": None
                want = fm.quantize_mx(w, dim)
                _same(got.data, want.data)
                _same(got.scale_inv, want.scale_inv)
                _same_values(got_x, want.dequantize(torch.float32))
        finally:
            fm._kernels = real
    elif case == "mx_groups":
        x = _x(45, 48, 6, device=device)
        counts = [7, 0, 33, 5]
        ref = fm.quantize_mx_groups(x.cpu(), counts)
        rows_S, s_pad = fm.padded_rows(counts, device, rows=45)
        xp = x.new_zeros(s_pad, 48).index_copy_(0, rows_S, x)
        q, s = tq.mx_quantize(xp.t(), "floor", block_m=16)
        _same(q.t(), ref.data.to(device))
        _same(s.t(), ref.scale_inv.to(device))
        got = tq.mx_dequant(q, s, s_pad, torch.float32, block=(16, 32)).t()
        _same_values(got.index_select(0, rows_S).cpu(), ref.dequantize(torch.float32))
    elif case == "int64_offsets":
        # element offsets of rows 300_000.. with a row stride of 8192: past 2**31
        import triton
        import triton.language as tl

        globals()["_offs"] = tq._offs  # jit functions resolve names in module globals

        @triton.jit
        def kernel(out_ptr, base, s0, s1):
            rows = base + tl.arange(0, 4)
            o = _offs(rows, tl.arange(0, 2), s0, s1)  # noqa: F821 - set in globals above
            tl.store(out_ptr + tl.arange(0, 4)[:, None] * 2 + tl.arange(0, 2)[None, :], o)

        out = torch.empty(4, 2, dtype=torch.int64, device=device)
        kernel[(1,)](out, 300_000, 8192, 1)
        assert out.tolist() == [[(300_000 + i) * 8192 + j for j in range(2)] for i in range(4)]
    elif case == "mx_block_is_formats_block":
        # the kernels' tile width is written where triton lives, apart from formats.py
        from dropless.ops.quantize.triton_fp8 import MX_BLOCK

        assert MX_BLOCK == fm.BLOCK == 32
    elif case == "dispatch_moe_steps":
        _dispatch_moe_steps(fm, tq, device)
    else:
        raise AssertionError(case)


def _dispatch_moe_steps(fm, tq, device):
    """A MoE forward+backward under each recipe: formats.py through the kernels (forced
    for CPU tensors here) equals the torch forms bit for bit."""
    import dropless
    from dropless.quant import recipe_from_name

    def step(recipe_name, opts):
        torch.manual_seed(0)
        moe = dropless.MoE(64, 32, 6, 2, device=device)
        x = torch.randn(20, 64, device=device, requires_grad=True)
        recipe = recipe_from_name(recipe_name, fp8_format="E4M3", **opts)
        with dropless.autocast(recipe=recipe):
            out, _ = moe(x)
            (out * torch.linspace(-1, 1, 64, device=device)).sum().backward()
        return [out, x.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad]

    real = fm._kernels

    def on(t, fmt="e4m3"):
        return tq if fmt == "e4m3" else None

    def off(t, fmt="e4m3"):
        return None

    saved = dict(fp8_saved_activations=True)
    for name, opts in (
        ("current", dict(granularity="row")),
        ("current", saved),
        ("delayed", saved),
        ("mxfp8", saved),
        ("mxfp8", dict(scale_rule="rceil")),
    ):
        try:
            fm._kernels = on
            got = step(name, opts)
            fm._kernels = off
            want = step(name, opts)
        finally:
            fm._kernels = real
        for g, w in zip(got, want):
            _same_values(g.detach().cpu(), w.detach().cpu())


test_interpreted, test_cuda = interpreted_tests(CASES, check)


@pytest.mark.gpu
def test_amax_cuda_matches_torch():
    from dropless.quant.formats import amax

    x = _edges(_x(64, 96, 7, torch.bfloat16, "cuda"))
    for dims in (None, 0, 1):
        want = x.abs().float()
        want = want.amax() if dims is None else want.amax(dims, keepdim=True)
        _same_values(amax(x, dims), want)
