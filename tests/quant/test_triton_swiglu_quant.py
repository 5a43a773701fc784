"""The Triton SwiGLU x prob + quantize kernel against the torch quantizers.

The kernel runs under TRITON_INTERPRET=1 in the interpreted child process
(tests/interpreted.py), the variable set before triton is imported; each test reports
its case. ACT=False cases (gate * up * prob, no exp) are compared
bit for bit; with the silu, exp may differ by an ulp between numpy and torch, so
those cases allow a rare one-code difference.
"""

# S rows, F expert hidden dim

from __future__ import annotations

import torch

from interpreted import interpreted_tests

CASES = [
    "e4m3_encoding_exhaustive",
    "mx_floor_bitexact",
    "mx_rceil_bitexact",
    "mx_edge_values",
    "mx_with_silu",
    "scaled_bitexact",
    "scaled_with_silu",
    "no_prob",
    "int64_offsets",
]


def _offsets_kernel():
    """A one-program kernel that writes the quantize kernels' element offsets of rows
    [base, base + 4) x columns [0, 2) for a row stride."""
    import triton
    import triton.language as tl

    from dropless.ops.activation.swiglu_quant_kernels import _offsets

    globals()["_offsets"] = _offsets  # jit functions resolve names in module globals

    @triton.jit
    def kernel(out_ptr, base, stride):
        rows = base + tl.arange(0, 4)  # int32, as the kernels compute them
        cols = tl.arange(0, 2)
        o = _offsets(rows, cols, stride)
        tl.store(out_ptr + tl.arange(0, 4)[:, None] * 2 + tl.arange(0, 2)[None, :], o)

    return kernel


def _h(S, F, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, 2 * F, generator=g) * scale, torch.rand(S, generator=g)


def _same_bytes(a, b):
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
        a.view(torch.uint8) != b.view(torch.uint8)
    ).sum()


def check(case: str, device: str = "cpu") -> None:
    from dropless.quant import formats as fm
    from dropless.quant.mlp import _swiglu_f32, swiglu_quant_mx, swiglu_quant_scaled

    if case == "int64_offsets":
        # h [S, 2F] with F = 4096: row 300_000 starts at element 2.46e9 > 2**31
        out = torch.empty(4, 2, dtype=torch.int64)
        base, stride = 300_000, 8192
        _offsets_kernel()[(1,)](out, base, stride)
        want = [[(base + i) * stride + j for j in range(2)] for i in range(4)]
        assert out.tolist() == want, out.tolist()
        return
    if case == "e4m3_encoding_exhaustive":
        # every E4M3 value, every midpoint between neighbours (ties), and beyond max
        vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        vals = vals[torch.isfinite(vals)].unique()
        mids = (vals[1:] + vals[:-1]) / 2
        x = torch.cat([vals, mids, mids + 1e-7, torch.tensor([500.0, -1e4, 2.0**-12])])
        F = x.numel()
        h = torch.cat([x, torch.ones(F)]).unsqueeze(0)
        q, _ = swiglu_quant_scaled(h, None, "e4m3", torch.tensor(1.0), act=False)
        _same_bytes(q.data, fm.cast_fp8(x, "e4m3").unsqueeze(0))
    elif case in ("mx_floor_bitexact", "mx_rceil_bitexact", "mx_edge_values", "no_prob"):
        rule = "rceil" if case == "mx_rceil_bitexact" else "floor"
        h, prob = _h(37, 80, 1)
        if case == "mx_edge_values":
            h[0, :32] = 0.0  # all-zero block
            h[1, 0], h[1, 80] = 30.0, 30.0  # 900 / prob: saturates
            h[2, 33], h[2, 113] = float("nan"), 1.0
            h[3, 70], h[3, 150] = float("inf"), 1.0
            h[4, :80] *= 1e-20  # subnormal-range products
            prob[5] = 0.0
        if case == "no_prob":
            prob = None
        q = swiglu_quant_mx(h, prob, scale_rule=rule, act=False, block_s=16)
        gate, up = h.chunk(2, dim=1)
        a = gate * up if prob is None else gate * up * prob.unsqueeze(1)
        ref = fm.quantize_mx(a, 1, scale_rule=rule)
        _same_bytes(q.data, ref.data)
        _same_bytes(q.scale_inv, ref.scale_inv)
    elif case == "mx_with_silu":
        h, prob = _h(40, 64, 2)
        q = swiglu_quant_mx(h, prob)
        ref = fm.quantize_mx(_swiglu_f32(h, prob), 1)
        diff = (q.data.view(torch.uint8).int() - ref.data.view(torch.uint8).int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
        assert (
            float((q.scale_inv.view(torch.uint8) != ref.scale_inv.view(torch.uint8)).float().mean())
            < 0.01
        )
    elif case in ("scaled_bitexact", "scaled_with_silu"):
        h, prob = _h(33, 50, 3)
        act = case == "scaled_with_silu"
        scale = torch.tensor(37.5)
        q, amax = swiglu_quant_scaled(h, prob, "e4m3", scale, act=act, block_s=16, block_f=32)
        gate, up = h.chunk(2, dim=1)
        a = _swiglu_f32(h, prob) if act else gate * up * prob.unsqueeze(1)
        ref = fm.quantize_scaled(a, "e4m3", scale)
        if act:
            diff = (q.data.view(torch.uint8).int() - ref.data.view(torch.uint8).int()).abs()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
            torch.testing.assert_close(amax, a.abs().max())
        else:
            _same_bytes(q.data, ref.data)
            assert float(amax) == float(a.abs().max())
            # a NaN of each sign: the byte keeps the sign, as torch's cast does
            h[2, 3], h[4, 7] = float("nan"), -float("nan")
            q, _ = swiglu_quant_scaled(h, prob, "e4m3", scale, act=False, block_s=16, block_f=32)
            gate, up = h.chunk(2, dim=1)
            _same_bytes(
                q.data, fm.quantize_scaled(gate * up * prob.unsqueeze(1), "e4m3", scale).data
            )
        assert torch.equal(q.scale_inv, ref.scale_inv)
    else:
        raise AssertionError(case)


test_interpreted, _ = interpreted_tests(CASES, check, cuda_cases=())
